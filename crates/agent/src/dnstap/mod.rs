//! dnstap: the query/response stream CoreDNS's `dnstap` plugin writes, for the tools that read
//! it (the `dnstap` CLI, dnstap-receiver, Vector, ...).
//!
//! - [`Tap`]: the data-path end of one `dnstap` directive ([`crate::config::Dnstap`], parsed
//!   with the rest of the configuration). [`Tap::client`] encodes a CLIENT_QUERY and a CLIENT_RESPONSE
//!   message ([`proto`]) and puts them in a bounded queue without waiting: a full queue drops
//!   and counts, as CoreDNS does. The data path never does I/O for dnstap.
//! - the writer thread (one per tap) owns the connection: it dials the Unix socket or TCP
//!   address, opens the bidirectional Frame Streams session ([`frame`]), writes the queue out,
//!   flushes at least every second, and when the connection fails drops what arrives and redials
//!   with a backoff (100 ms doubling to 10 s). When the tap goes (a reload that changes it) or
//!   is finished ([`finish`], at shutdown, once the last answers are sent), the thread writes
//!   out what is queued, sends STOP, waits for FINISH, and ends; the shutdown waits for that,
//!   bounded, so that the last messages reach the reader.
//! - [`Metrics`]: messages sent and dropped, and whether the sink is connected, per endpoint.
//!
//! Both messages of a query are written when its answer is sent (CoreDNS writes the query
//! message when the query arrives); their timestamps are the query's arrival and the answer's.

pub mod frame;
pub mod proto;

use std::cell::RefCell;
use std::fmt;
use std::io::{self, BufWriter, Read, Write};
use std::net::{SocketAddr, TcpStream, ToSocketAddrs};
use std::os::unix::net::UnixStream;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::mpsc::{Receiver, RecvTimeoutError, SyncSender, TrySendError};
use std::sync::{Arc, Condvar, Mutex, PoisonError};
use std::time::{Duration, Instant, SystemTime};

use prometheus_client::encoding::{DescriptorEncoder, NoLabelSet};
use prometheus_client::metrics::MetricType;

use crate::config::{Dnstap, Sink};

/// CoreDNS's dial, read and write timeout.
const TIMEOUT: Duration = Duration::from_secs(4);
/// CoreDNS flushes every second.
const FLUSH: Duration = Duration::from_secs(1);
/// CoreDNS logs dropped messages every 10 s.
const REPORT: Duration = Duration::from_secs(10);
const FIRST_BACKOFF: Duration = Duration::from_millis(100);
const MAX_BACKOFF: Duration = Duration::from_secs(10);

/// Per-endpoint figures, kept across reloads.
#[derive(Debug, Default)]
struct Stats {
    sent: AtomicU64,
    dropped: AtomicU64,
    connected: AtomicBool,
}

/// The taps' metrics.
#[derive(Debug, Default)]
pub struct Metrics {
    endpoints: Mutex<Vec<(String, Arc<Stats>)>>,
}

impl Metrics {
    fn stats(&self, endpoint: &Sink) -> Arc<Stats> {
        let name = endpoint.to_string();
        let mut endpoints = self
            .endpoints
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        if let Some((_, stats)) = endpoints.iter().find(|(e, _)| *e == name) {
            return stats.clone();
        }
        let stats = Arc::new(Stats::default());
        endpoints.push((name, stats.clone()));
        stats
    }

    /// Messages (sent, dropped) so far for `endpoint`.
    pub fn counts(&self, endpoint: &Sink) -> (u64, u64) {
        let s = self.stats(endpoint);
        (
            s.sent.load(Ordering::Relaxed),
            s.dropped.load(Ordering::Relaxed),
        )
    }

    /// Writes the families, when a tap was ever configured.
    pub fn encode(&self, encoder: &mut DescriptorEncoder<'_>) -> fmt::Result {
        let endpoints = self
            .endpoints
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .clone();
        if endpoints.is_empty() {
            return Ok(());
        }
        for (name, help, pick) in [
            (
                "nodedns_dnstap_sent",
                "dnstap messages handed to the sink's connection.",
                (|s: &Stats| s.sent.load(Ordering::Relaxed)) as fn(&Stats) -> u64,
            ),
            (
                "nodedns_dnstap_dropped",
                "dnstap messages dropped: the queue was full or the sink unreachable.",
                |s: &Stats| s.dropped.load(Ordering::Relaxed),
            ),
        ] {
            let mut m = encoder.encode_descriptor(name, help, None, MetricType::Counter)?;
            for (endpoint, stats) in &endpoints {
                m.encode_family(&[("endpoint", endpoint.as_str())])?
                    .encode_counter::<NoLabelSet, u64, u64>(&pick(stats), None)?;
            }
        }
        let mut m = encoder.encode_descriptor(
            "nodedns_dnstap_connected",
            "Whether the dnstap sink is connected (1) or being redialled (0).",
            None,
            MetricType::Gauge,
        )?;
        for (endpoint, stats) in &endpoints {
            m.encode_family(&[("endpoint", endpoint.as_str())])?
                .encode_gauge(&u64::from(stats.connected.load(Ordering::Relaxed)))?;
        }
        Ok(())
    }
}

/// The taps' metrics as a collector for the registry.
#[derive(Debug)]
pub struct Collector(pub Arc<Metrics>);

impl prometheus_client::collector::Collector for Collector {
    fn encode(&self, mut encoder: DescriptorEncoder) -> fmt::Result {
        self.0.encode(&mut encoder)
    }
}

/// One tap: the data path's end of the queue. Dropping it ends the writer thread (after STOP).
#[derive(Debug)]
pub struct Tap {
    config: Dnstap,
    header: proto::Header,
    /// Encoded messages; an empty one only wakes the writer (every message has bytes).
    queue: SyncSender<Vec<u8>>,
    seq: AtomicU64,
    stats: Arc<Stats>,
    closing: Arc<Closing>,
}

/// The end of a writer thread, between [`Tap::finish`] and the thread.
#[derive(Debug, Default)]
struct Closing {
    /// The shutdown asked the writer to close its session and end.
    asked: AtomicBool,
    /// The writer thread has ended.
    ended: Mutex<bool>,
    cv: Condvar,
}

impl Closing {
    fn asked(&self) -> bool {
        self.asked.load(Ordering::Acquire)
    }

    fn end(&self) {
        *self.ended.lock().unwrap_or_else(PoisonError::into_inner) = true;
        self.cv.notify_all();
    }
}

/// Finishes every tap in `taps` ([`Tap::finish`]), all by `deadline`. Returns the sinks whose
/// writer had not ended by then (still dialling, or a reader that never sent FINISH).
pub fn finish<'a>(taps: impl IntoIterator<Item = &'a Tap>, deadline: Instant) -> Vec<String> {
    let taps: Vec<&Tap> = taps.into_iter().collect();
    for tap in &taps {
        tap.ask_to_finish();
    }
    taps.into_iter()
        .filter(|tap| !tap.wait_ended(deadline))
        .map(|tap| tap.config.sink.to_string())
        .collect()
}

thread_local! {
    /// The embedded message while it is measured (see [`proto::encode`]).
    static SCRATCH: RefCell<Vec<u8>> = RefCell::new(Vec::with_capacity(1024));
}

fn host_name() -> String {
    std::fs::read_to_string("/proc/sys/kernel/hostname")
        .map(|h| h.trim().to_owned())
        .unwrap_or_default()
}

impl Tap {
    /// Starts the tap's writer thread. It dials at once, and again whenever the connection
    /// fails; nothing here waits for the sink.
    pub fn start(config: Dnstap, metrics: &Metrics) -> io::Result<Arc<Tap>> {
        let stats = metrics.stats(&config.sink);
        let (queue, rx) = std::sync::mpsc::sync_channel(config.queue.max(1));
        let header = proto::Header {
            identity: config
                .identity
                .clone()
                .unwrap_or_else(host_name)
                .into_bytes(),
            version: config
                .version
                .clone()
                .unwrap_or_else(|| format!("nodedns-{}", env!("CARGO_PKG_VERSION")))
                .into_bytes(),
            extra: config.extra.clone().map(String::into_bytes),
        };
        let closing = Arc::new(Closing::default());
        let writer = Writer {
            endpoint: config.sink.clone(),
            write_buffer: config.write_buffer,
            stats: stats.clone(),
            reported: 0,
            last_report: Instant::now(),
            closing: closing.clone(),
        };
        std::thread::Builder::new()
            .name("dnstap".to_owned())
            .spawn(move || {
                let closing = writer.closing.clone();
                writer.run(&rx);
                // Closed before the end is announced: what is tapped once `finish` returned
                // finds the queue disconnected, and is dropped and counted.
                drop(rx);
                closing.end();
            })?;
        Ok(Arc::new(Tap {
            config,
            header,
            queue,
            seq: AtomicU64::new(0),
            stats,
            closing,
        }))
    }

    /// Has the writer write out what is queued, close the session (STOP, then the reader's
    /// FINISH) and end, and waits for that until `deadline`. Whether it ended. What is tapped
    /// afterwards is dropped (and counted).
    pub fn finish(&self, deadline: Instant) -> bool {
        self.ask_to_finish();
        self.wait_ended(deadline)
    }

    fn ask_to_finish(&self) {
        self.closing.asked.store(true, Ordering::Release);
        // Wakes a writer waiting for the queue; one with a full queue is busy and looks anyway.
        let _ = self.queue.try_send(Vec::new());
    }

    fn wait_ended(&self, deadline: Instant) -> bool {
        let c = &self.closing;
        let mut ended = c.ended.lock().unwrap_or_else(PoisonError::into_inner);
        while !*ended {
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return false;
            }
            ended =
                c.cv.wait_timeout(ended, left)
                    .unwrap_or_else(PoisonError::into_inner)
                    .0;
        }
        true
    }

    pub fn config(&self) -> &Dnstap {
        &self.config
    }

    /// Taps one answered query: `query` as received, `response` as sent, `elapsed` since the
    /// query arrived (zero for answers from the cache).
    pub fn client(
        &self,
        query: &[u8],
        response: &[u8],
        client: SocketAddr,
        tcp: bool,
        elapsed: Duration,
    ) {
        if self.config.sample > 1
            && self.seq.fetch_add(1, Ordering::Relaxed) % u64::from(self.config.sample) != 0
        {
            return;
        }
        let now = SystemTime::now();
        let query_time = now.checked_sub(elapsed).unwrap_or(now);
        let transport = if tcp {
            proto::Transport::Tcp
        } else {
            proto::Transport::Udp
        };
        let full = self.config.full;
        for (kind, message, response_time) in [
            (proto::Kind::ClientQuery, query, None),
            (proto::Kind::ClientResponse, response, Some(now)),
        ] {
            let event = proto::Event {
                kind,
                transport,
                client: (client.ip(), client.port()),
                query_time,
                response_time,
                message: full.then_some(message),
            };
            let mut out = Vec::with_capacity(96 + if full { message.len() } else { 0 });
            SCRATCH.with(|scratch| {
                proto::encode(&self.header, &event, &mut scratch.borrow_mut(), &mut out);
            });
            match self.queue.try_send(out) {
                Ok(()) => {}
                Err(TrySendError::Full(_) | TrySendError::Disconnected(_)) => {
                    self.stats.dropped.fetch_add(1, Ordering::Relaxed);
                }
            }
        }
    }
}

/// A connection to the sink.
#[derive(Debug)]
enum Conn {
    Unix(UnixStream),
    Tcp(TcpStream),
}

impl Read for Conn {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        match self {
            Conn::Unix(s) => s.read(buf),
            Conn::Tcp(s) => s.read(buf),
        }
    }
}

impl Write for Conn {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        match self {
            Conn::Unix(s) => s.write(buf),
            Conn::Tcp(s) => s.write(buf),
        }
    }

    fn flush(&mut self) -> io::Result<()> {
        match self {
            Conn::Unix(s) => s.flush(),
            Conn::Tcp(s) => s.flush(),
        }
    }
}

fn dial(endpoint: &Sink, write_buffer: usize) -> io::Result<Conn> {
    match endpoint {
        Sink::Unix(path) => {
            let s = UnixStream::connect(path)?;
            s.set_read_timeout(Some(TIMEOUT))?;
            s.set_write_timeout(Some(TIMEOUT))?;
            Ok(Conn::Unix(s))
        }
        Sink::Tcp(addr) => {
            let mut last = io::Error::new(io::ErrorKind::NotFound, "the name has no address");
            for a in addr.to_socket_addrs()? {
                match TcpStream::connect_timeout(&a, TIMEOUT) {
                    Ok(s) => {
                        s.set_read_timeout(Some(TIMEOUT))?;
                        s.set_write_timeout(Some(TIMEOUT))?;
                        let _ = socket2::SockRef::from(&s).set_send_buffer_size(write_buffer);
                        return Ok(Conn::Tcp(s));
                    }
                    Err(e) => last = e,
                }
            }
            Err(last)
        }
    }
}

/// Why a session ended.
enum End {
    /// The tap is gone: the thread ends.
    Closed,
    Failed(io::Error),
}

/// The writer thread's state.
struct Writer {
    endpoint: Sink,
    write_buffer: usize,
    stats: Arc<Stats>,
    /// Drops already logged.
    reported: u64,
    last_report: Instant,
    closing: Arc<Closing>,
}

impl Writer {
    fn run(mut self, rx: &Receiver<Vec<u8>>) {
        let mut backoff = FIRST_BACKOFF;
        let mut failing = false;
        loop {
            if self.closing.asked() {
                return;
            }
            let session = dial(&self.endpoint, self.write_buffer).and_then(|mut conn| {
                frame::open(&mut conn)?;
                Ok(conn)
            });
            match session {
                Ok(conn) => {
                    tracing::info!(endpoint = %self.endpoint, "dnstap connected");
                    self.stats.connected.store(true, Ordering::Relaxed);
                    backoff = FIRST_BACKOFF;
                    failing = false;
                    let end = self.serve(conn, rx);
                    self.stats.connected.store(false, Ordering::Relaxed);
                    match end {
                        End::Closed => return,
                        End::Failed(err) => {
                            tracing::warn!(endpoint = %self.endpoint, %err, "dnstap connection lost; redialling");
                        }
                    }
                }
                Err(err) if !failing => {
                    failing = true;
                    tracing::warn!(endpoint = %self.endpoint, %err, "no connection to the dnstap endpoint; redialling (messages are dropped meanwhile)");
                }
                Err(err) => tracing::debug!(endpoint = %self.endpoint, %err, "dnstap dial failed"),
            }
            // Until the next dial, what arrives is dropped: the queue must keep taking the data
            // path's messages, and fresh ones are worth more than old ones.
            let until = Instant::now() + backoff;
            loop {
                let left = until.saturating_duration_since(Instant::now());
                match rx.recv_timeout(left) {
                    // Nothing to close: the writer ends.
                    Ok(_) if self.closing.asked() => return,
                    Ok(_) => {
                        self.stats.dropped.fetch_add(1, Ordering::Relaxed);
                        self.report();
                    }
                    Err(RecvTimeoutError::Timeout) => break,
                    Err(RecvTimeoutError::Disconnected) => return,
                }
            }
            backoff = (backoff * 2).min(MAX_BACKOFF);
        }
    }

    /// Logs the drops of the last interval, as CoreDNS does ("Dropped dnstap messages").
    fn report(&mut self) {
        if self.last_report.elapsed() < REPORT {
            return;
        }
        self.last_report = Instant::now();
        let dropped = self.stats.dropped.load(Ordering::Relaxed);
        if dropped > self.reported {
            tracing::warn!(endpoint = %self.endpoint, dropped = dropped - self.reported, "dropped dnstap messages");
            self.reported = dropped;
        }
    }

    /// Writes the queue out until the tap goes or is finished, or the connection fails.
    fn serve(&mut self, conn: Conn, rx: &Receiver<Vec<u8>>) -> End {
        let mut w = BufWriter::with_capacity(64 << 10, conn);
        let mut frame = Vec::with_capacity(1024);
        loop {
            self.report();
            let first = match rx.recv_timeout(FLUSH) {
                Ok(payload) => payload,
                Err(RecvTimeoutError::Timeout) if self.closing.asked() => return self.close(w),
                Err(RecvTimeoutError::Timeout) => {
                    if let Err(err) = w.flush() {
                        return End::Failed(err);
                    }
                    continue;
                }
                Err(RecvTimeoutError::Disconnected) => return self.close(w),
            };
            // Write what is queued, then flush: a quiet tap's messages leave at once, a busy
            // one's in full buffers.
            let mut next = Some(first);
            while let Some(payload) = next {
                // An empty one is the wake-up of `Tap::finish`, not a message (a frame of
                // length 0 would be a control frame's escape).
                if !payload.is_empty() {
                    frame.clear();
                    frame::data(&mut frame, &payload);
                    if let Err(err) = w.write_all(&frame) {
                        self.stats.dropped.fetch_add(1, Ordering::Relaxed);
                        return End::Failed(err);
                    }
                    self.stats.sent.fetch_add(1, Ordering::Relaxed);
                }
                next = rx.try_recv().ok();
            }
            if self.closing.asked() {
                return self.close(w);
            }
            if let Err(err) = w.flush() {
                return End::Failed(err);
            }
        }
    }

    /// Writes out what is buffered and closes the session: STOP, the reader's FINISH.
    fn close(&self, w: BufWriter<Conn>) -> End {
        let closed = w
            .into_inner()
            .map_err(|e| e.into_error())
            .and_then(|mut conn| frame::close(&mut conn));
        if let Err(err) = closed {
            tracing::debug!(endpoint = %self.endpoint, %err, "dnstap close");
        }
        End::Closed
    }
}

#[cfg(test)]
mod tests;
