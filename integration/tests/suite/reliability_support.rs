//! What the reliability tests share: a load generator that counts every query it sent as
//! answered, failed or lost (no answer within its own deadline), agents started on a given
//! address, waiting for a line in a process's log, a /metrics scrape, and a process's memory.

use std::collections::HashMap;
use std::ffi::OsStr;
use std::net::{Ipv4Addr, SocketAddr};
use std::process::Command;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use hickory_proto::op::{Message, MessageType, ResponseCode};
use hickory_proto::rr::RecordType;
use nodedns_integration::{Process, client, nodedns_bin};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpStream, UdpSocket};

/// The runtime the tests' clients run on.
pub fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("runtime")
}

/// A query the load sends: its name and type.
pub type Query = (String, RecordType);

/// A steady stream of UDP queries, each with its own ID and deadline.
#[derive(Clone)]
pub struct Load {
    pub target: SocketAddr,
    /// Queries per second, spread over `sockets`.
    pub qps: u32,
    pub duration: Duration,
    /// Client sockets (source ports): the kernel spreads them over the agent's workers.
    pub sockets: usize,
    /// A query with no answer this long after it was sent is lost.
    pub deadline: Duration,
    /// The n-th query (0, 1, ...).
    pub query: Arc<dyn Fn(u64) -> Query + Send + Sync>,
}

impl std::fmt::Debug for Load {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Load")
            .field("target", &self.target)
            .field("qps", &self.qps)
            .field("duration", &self.duration)
            .finish()
    }
}

/// What happened to every query a load sent.
#[derive(Debug, Default, Clone)]
pub struct Report {
    pub sent: u64,
    /// NOERROR or NXDOMAIN, answering the question asked.
    pub answered: u64,
    pub servfail: u64,
    /// Another RCODE, or a reply to another question.
    pub wrong: u64,
    /// No answer within the deadline.
    pub lost: u64,
    /// Answers that came after their query was counted lost.
    pub late: u64,
    pub max_latency: Duration,
    /// When (since the start) the first lost queries were sent, and what they asked.
    pub lost_examples: Vec<(Duration, String)>,
    pub failed_examples: Vec<String>,
}

impl Report {
    fn merge(&mut self, other: Report) {
        self.sent += other.sent;
        self.answered += other.answered;
        self.servfail += other.servfail;
        self.wrong += other.wrong;
        self.lost += other.lost;
        self.late += other.late;
        self.max_latency = self.max_latency.max(other.max_latency);
        self.lost_examples.extend(other.lost_examples);
        self.lost_examples.sort();
        self.lost_examples.truncate(20);
        self.failed_examples.extend(other.failed_examples);
        self.failed_examples.truncate(20);
    }

    /// Queries that did not get a good answer in time.
    pub fn failures(&self) -> u64 {
        self.servfail + self.wrong + self.lost
    }
}

struct Pending {
    sent: Instant,
    name: String,
    rtype: RecordType,
}

impl Load {
    /// Sends for `duration`, then waits one deadline for the last answers.
    pub async fn run(self) -> Report {
        let start = Instant::now();
        let counter = Arc::new(AtomicU64::new(0));
        let mut tasks = Vec::new();
        for _ in 0..self.sockets.max(1) {
            let load = self.clone();
            let counter = counter.clone();
            tasks.push(tokio::spawn(async move {
                load.run_socket(start, counter).await
            }));
        }
        let mut report = Report::default();
        for task in tasks {
            report.merge(task.await.expect("load task"));
        }
        report
    }

    async fn run_socket(self, start: Instant, counter: Arc<AtomicU64>) -> Report {
        let socket = Arc::new(
            UdpSocket::bind((Ipv4Addr::LOCALHOST, 0))
                .await
                .expect("client socket"),
        );
        let pending: Arc<Mutex<HashMap<u16, Pending>>> = Arc::default();
        let report = Arc::new(Mutex::new(Report::default()));
        let sockets = self.sockets.max(1) as u32;
        let period = Duration::from_secs(1) * sockets / self.qps.max(1);
        let total = (self.duration.as_secs_f64() * f64::from(self.qps) / f64::from(sockets)) as u64;

        let receiving = {
            let (socket, pending, report) = (socket.clone(), pending.clone(), report.clone());
            let deadline = self.deadline;
            tokio::spawn(async move {
                let mut buf = vec![0; 65535];
                let mut sweep = tokio::time::interval(Duration::from_millis(50));
                loop {
                    tokio::select! {
                        received = socket.recv_from(&mut buf) => {
                            let Ok((n, _)) = received else { continue };
                            settle(&buf[..n], &pending, &report);
                        }
                        _ = sweep.tick() => expire(&pending, &report, deadline, start),
                    }
                }
            })
        };

        let mut id: u16 = rand::random();
        for i in 0..total {
            tokio::time::sleep_until((start + period * i as u32).into()).await;
            let n = counter.fetch_add(1, Ordering::Relaxed);
            let (name, rtype) = (self.query)(n);
            id = id.wrapping_add(1);
            let mut message = client::query(&name, rtype);
            message.metadata.id = id;
            let bytes = message.to_vec().expect("encode query");
            {
                let mut pending = pending.lock().unwrap();
                if pending.contains_key(&id) {
                    // 65536 queries in flight on one socket: the load is broken, not the agent.
                    panic!("ID {id} still pending: raise `sockets`");
                }
                pending.insert(
                    id,
                    Pending {
                        sent: Instant::now(),
                        name,
                        rtype,
                    },
                );
            }
            report.lock().unwrap().sent += 1;
            if socket.send_to(&bytes, self.target).await.is_err() {
                // Counted lost by the sweep, like a datagram the network dropped.
            }
        }
        // Everything still pending is answered or counted lost within one deadline (and a
        // sweep).
        let _ = tokio::time::timeout(self.deadline * 2, async {
            while !pending.lock().unwrap().is_empty() {
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        })
        .await;
        receiving.abort();
        let _ = receiving.await;
        expire(&pending, &report, Duration::ZERO, start);
        let report = report.lock().unwrap();
        report.clone()
    }
}

fn settle(bytes: &[u8], pending: &Mutex<HashMap<u16, Pending>>, report: &Mutex<Report>) {
    let Ok(reply) = Message::from_vec(bytes) else {
        report.lock().unwrap().wrong += 1;
        return;
    };
    let Some(query) = pending.lock().unwrap().remove(&reply.metadata.id) else {
        report.lock().unwrap().late += 1;
        return;
    };
    let latency = query.sent.elapsed();
    let mut report = report.lock().unwrap();
    report.max_latency = report.max_latency.max(latency);
    let question_matches = reply.queries.first().is_some_and(|q| {
        q.name().to_ascii().eq_ignore_ascii_case(&query.name) && q.query_type() == query.rtype
    });
    if reply.metadata.message_type != MessageType::Response || !question_matches {
        report.wrong += 1;
        push_example(
            &mut report.failed_examples,
            format!("{} {}: {reply:?}", query.name, query.rtype),
        );
        return;
    }
    match reply.metadata.response_code {
        ResponseCode::NoError | ResponseCode::NXDomain => report.answered += 1,
        ResponseCode::ServFail => {
            report.servfail += 1;
            push_example(
                &mut report.failed_examples,
                format!("SERVFAIL {} {}", query.name, query.rtype),
            );
        }
        other => {
            report.wrong += 1;
            push_example(
                &mut report.failed_examples,
                format!("{other:?} {} {}", query.name, query.rtype),
            );
        }
    }
}

fn push_example(examples: &mut Vec<String>, example: String) {
    if examples.len() < 20 {
        examples.push(example);
    }
}

/// Counts queries older than `deadline` as lost.
fn expire(
    pending: &Mutex<HashMap<u16, Pending>>,
    report: &Mutex<Report>,
    deadline: Duration,
    start: Instant,
) {
    let now = Instant::now();
    let mut pending = pending.lock().unwrap();
    let expired: Vec<u16> = pending
        .iter()
        .filter(|(_, p)| now.duration_since(p.sent) >= deadline)
        .map(|(id, _)| *id)
        .collect();
    let mut report = report.lock().unwrap();
    for id in expired {
        if let Some(p) = pending.remove(&id) {
            report.lost += 1;
            if report.lost_examples.len() < 20 {
                report.lost_examples.push((
                    p.sent.duration_since(start),
                    format!("{} {}", p.name, p.rtype),
                ));
            }
        }
    }
}

/// One query per new TCP connection, `qps` times a second for `duration`; each must be answered
/// (NOERROR or NXDOMAIN) within `deadline`.
pub async fn tcp_load(
    target: SocketAddr,
    qps: u32,
    duration: Duration,
    deadline: Duration,
    query: Arc<dyn Fn(u64) -> Query + Send + Sync>,
) -> Report {
    let start = Instant::now();
    let period = Duration::from_secs(1) / qps.max(1);
    let total = (duration.as_secs_f64() * f64::from(qps)) as u64;
    let mut tasks = Vec::new();
    for i in 0..total {
        tokio::time::sleep_until((start + period * i as u32).into()).await;
        let (name, rtype) = query(i);
        tasks.push(tokio::spawn(async move {
            let message = client::query(&name, rtype);
            let sent = Instant::now();
            let exchange = async {
                let mut stream = TcpStream::connect(target).await?;
                client::write_frame(&mut stream, &message.to_vec()?).await?;
                let reply = client::read_frame(&mut stream).await?;
                anyhow::Ok(client::decode(&reply)?)
            };
            let mut report = Report {
                sent: 1,
                ..Report::default()
            };
            match tokio::time::timeout(deadline, exchange).await {
                Ok(Ok(reply))
                    if reply.metadata.id == message.metadata.id
                        && matches!(
                            reply.metadata.response_code,
                            ResponseCode::NoError | ResponseCode::NXDomain
                        ) =>
                {
                    report.answered = 1;
                    report.max_latency = sent.elapsed();
                }
                Ok(Ok(reply)) => {
                    report.wrong = 1;
                    report.failed_examples.push(format!("{name}: {reply:?}"));
                }
                Ok(Err(err)) => {
                    report.lost = 1;
                    report.failed_examples.push(format!("{name}: {err:#}"));
                }
                Err(_) => {
                    report.lost = 1;
                    report
                        .lost_examples
                        .push((sent.duration_since(start), name.clone()));
                }
            }
            report
        }));
    }
    let mut report = Report::default();
    for task in tasks {
        report.merge(task.await.expect("TCP query task"));
    }
    report
}

/// `nodedns run --listen <listen> --upstream <u>... <extra>`, not waited for.
pub fn spawn_agent<S: AsRef<OsStr>>(
    name: &str,
    listen: SocketAddr,
    upstreams: &[SocketAddr],
    extra: &[S],
) -> anyhow::Result<Process> {
    let mut command = Command::new(nodedns_bin());
    command
        .arg("run")
        .arg("--listen")
        .arg(listen.to_string())
        .env("RUST_BACKTRACE", "1")
        .env("NO_COLOR", "1");
    for upstream in upstreams {
        command.arg("--upstream").arg(upstream.to_string());
    }
    command.args(extra);
    Process::spawn(name, command).context("spawn nodedns")
}

/// Waits until `output()` contains `needle`, or fails after `limit` with the output.
pub fn wait_for_line(
    what: &str,
    limit: Duration,
    mut output: impl FnMut() -> String,
    needle: &str,
) -> anyhow::Result<()> {
    let deadline = Instant::now() + limit;
    loop {
        let text = output();
        if text.contains(needle) {
            return Ok(());
        }
        if Instant::now() >= deadline {
            bail!("{what}: no {needle:?} within {limit:?}; output:\n{text}");
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// `GET /metrics` from `addr`: the Prometheus text.
pub async fn scrape(addr: SocketAddr) -> anyhow::Result<String> {
    let mut stream = TcpStream::connect(addr).await?;
    stream
        .write_all(b"GET /metrics HTTP/1.1\r\nHost: nodedns\r\nConnection: close\r\n\r\n")
        .await?;
    let mut text = String::new();
    tokio::time::timeout(Duration::from_secs(5), stream.read_to_string(&mut text))
        .await
        .context("scrape timed out")??;
    let (_, body) = text.split_once("\r\n\r\n").context("no HTTP body")?;
    Ok(body.to_owned())
}

/// The sum of every sample of metric `name` (any labels) in a Prometheus text.
pub fn metric(text: &str, name: &str) -> Option<f64> {
    let mut found = None;
    for line in text.lines() {
        if line.starts_with('#') {
            continue;
        }
        let Some(rest) = line.strip_prefix(name) else {
            continue;
        };
        if !(rest.starts_with(' ') || rest.starts_with('{')) {
            continue;
        }
        let value: f64 = rest.rsplit(' ').next()?.parse().ok()?;
        *found.get_or_insert(0.0) += value;
    }
    found
}

/// (VmRSS, VmHWM) of process `pid`, in bytes.
pub fn memory(pid: u32) -> anyhow::Result<(u64, u64)> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status"))?;
    let field = |key: &str| -> anyhow::Result<u64> {
        let line = status
            .lines()
            .find(|l| l.starts_with(key))
            .with_context(|| format!("no {key} in /proc/{pid}/status"))?;
        let kib: u64 = line
            .split_whitespace()
            .nth(1)
            .context("no value")?
            .parse()?;
        Ok(kib * 1024)
    };
    Ok((field("VmRSS:")?, field("VmHWM:")?))
}

/// A loopback address free for UDP and TCP.
pub fn free_addr() -> SocketAddr {
    SocketAddr::from((
        Ipv4Addr::LOCALHOST,
        nodedns_integration::free_port().expect("free port"),
    ))
}
