//! UDP listeners: one OS thread per listen address and worker, each with a runtime of its own.
//!
//! Each worker owns its own socket in the address's `SO_REUSEPORT` group, so the kernel spreads
//! clients over workers with no shared queue and no lock. The loop:
//!
//! 1. `recvmmsg` a batch (blocks until at least one datagram is there, then takes what is queued);
//! 2. for each datagram run [`pipeline::answer`]: a hit or a refusal is written into that slot's
//!    reusable output buffer; a miss becomes a task with a [`Waiter`] (and the rare hit that
//!    starts a background refresh starts that task too, with no waiter);
//! 3. `sendmmsg` the batch of answers.
//!
//! The thread runs a current-thread tokio runtime, and a miss's task runs on it: the miss never
//! crosses threads (no wake-up of another thread, no context switch on a busy CPU), its
//! upstream connections are this runtime's (`nodedns_upstream` reuses a connection only on the
//! runtime that opened it), and its answer joins the others this runtime finished in the same
//! turn, and those of the replies that arrived meanwhile, in one `sendmmsg` ([`send`]: the
//! worker's outbox). A client reading a burst of answers wakes once for it, not once per part.
//!
//! How the worker waits for datagrams depends on whether upstream work is pending:
//! - **Nothing pending** (no task alive on its runtime): a blocking `recvmmsg`, the cheapest wait
//!   there is, as an echo server's; the socket is not registered with the runtime's reactor.
//!   A registered socket costs every arriving datagram an epoll callback, on the sender's CPU
//!   and on this one: 7 % more CPU per hit, measured on the echo server and on a worker alike.
//! - **Misses in flight**: the socket is registered and the worker waits on the reactor, so one
//!   `epoll_wait` covers the next datagrams and the upstream's replies. Batches are read without
//!   blocking, in turns: a turn reads while datagrams are queued, for as long as the tasks' last
//!   round took ([`MAX_TURN`] batches at most), then every task that is ready runs once. Under a
//!   flood, reading and resolving share the thread evenly: the misses read go upstream at once,
//!   and the hits queued behind them (other clients') are still read. A miss that finds
//!   [`pipeline::MAX_PENDING`] misses pending is answered SERVFAIL in the batch, as a hit is.
//! - **Many misses in flight** ([`COALESCE_FROM`] or more tasks alive): when the runtime finds
//!   nothing to do, the thread pauses [`COALESCE_PAUSE`] before it sleeps on the reactor
//!   ([`pause_before_sleep`]), so that the upstream replies and the datagrams arriving meanwhile
//!   wake it once, together. A worker far ahead of its upstream and its clients otherwise wakes for
//!   every event, and so do they: in the shared harness's miss phase (the worker on one CPU, the
//!   client and the upstream on the other) that state came and went within minutes, every process
//!   switching about five times as often, the client spending two to three times the CPU a query
//!   and the throughput about 40 % lower (docs/performance.md). With fewer misses in flight the
//!   worker sleeps at once: the pause only delays a worker whose upstream replies are due.
//!
//! The worker registers the socket as soon as a batch leaves a task alive, and withdraws it once
//! none has been alive for [`LINGER`]: a steady mix of hits and misses stays on the reactor, a
//! run of hits alone goes back to the blocking wait.
//!
//! Invariants: no allocation per query on the hit path after warm-up (buffers are reused), no
//! lock; a hit never awaits (a worker pausing with many misses in flight reads it at most
//! [`COALESCE_PAUSE`] later). The socket has a receive timeout so the blocking wait sees shutdown
//! within [`POLL`] even when no query arrives; the reactor's wait also wakes on [`Stop`]. A
//! stopped worker runs its runtime until its misses are answered ([`DRAIN`] at most).

use std::cell::RefCell;
use std::io::{self, IoSlice, IoSliceMut};
use std::net::{IpAddr, SocketAddr, UdpSocket};
use std::os::fd::AsRawFd;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use nix::errno::Errno;
use nix::sys::socket::{
    MsgFlags, MultiHeaders, SockaddrStorage, recvmmsg, sendmmsg, sendto, setsockopt, sockopt,
};
use rustix::net::sockopt::{Ipv4PathMtuDiscovery, set_ip_mtu_discover};
use socket2::{Domain, Protocol, Socket, Type};
use tokio::io::Interest;
use tokio::io::unix::AsyncFd;
use tokio::sync::watch;

use super::Shared;
use super::pipeline::{self, Front, Recorder, ReplyTo};
use super::ratelimit::{Clock, Limiter, Verdict};
use super::request::{Client, MAX_QUERY, Proto};
use crate::metrics::{Counters, Metrics};

/// Datagrams taken per `recvmmsg` at most.
const BATCH: usize = 64;
/// Datagrams asked for when the last batch was small.
const MIN_WANT: usize = 4;
/// How often a worker blocked in `recvmmsg` checks for shutdown.
const POLL: Duration = Duration::from_millis(100);
/// How long the socket stays registered with the reactor after the worker's last task ended:
/// misses that keep coming (a mix of hits and misses) do not pay for a registration each.
const LINGER: Duration = Duration::from_millis(20);
/// Batches a worker reads in one turn at most, before the tasks it started run.
const MAX_TURN: usize = 16;
/// Tasks alive on a worker's runtime (misses in flight, for the most part) from which it pauses
/// before it sleeps.
const COALESCE_FROM: usize = 32;
/// How long that pause lasts: about what a miss takes through a local upstream, so that the
/// replies of the misses in flight arrive within it.
const COALESCE_PAUSE: Duration = Duration::from_micros(100);
/// The timer slack of a worker's thread: the kernel may end its sleeps this much late (50 µs by
/// default, half the pause).
const TIMER_SLACK_NS: u64 = 1_000;
/// How long a stopped worker keeps running its runtime for the misses still in flight (the
/// upstream's deadline ends each well before).
const DRAIN: Duration = Duration::from_secs(5);
/// Socket buffer size asked for (the kernel doubles it for bookkeeping); a burst of misses or a
/// short stall of the worker must not drop queries.
const SOCKET_BUFFER: usize = 4 << 20;

/// Binds one UDP socket of `addr`'s `SO_REUSEPORT` group.
///
/// `IP_FREEBIND` lets it bind an address that is not (yet) on an interface: the kube-dns
/// ClusterIP only appears once the host plumbing has put it on the link.
pub fn bind(addr: SocketAddr) -> io::Result<UdpSocket> {
    let socket = Socket::new(Domain::for_address(addr), Type::DGRAM, Some(Protocol::UDP))?;
    socket.set_reuse_port(true)?;
    match addr {
        SocketAddr::V4(_) => socket.set_freebind_v4(true)?,
        SocketAddr::V6(_) => {
            socket.set_only_v6(true)?;
            socket.set_freebind_v6(true)?;
        }
    }
    set_buffers(&socket);
    socket.set_read_timeout(Some(POLL))?;
    socket
        .bind(&addr.into())
        .map_err(|e| super::sibling::in_use(addr, e))?;
    Ok(socket.into())
}

/// Large buffers: `SO_RCVBUFFORCE` when the process may exceed `rmem_max` (CAP_NET_ADMIN),
/// otherwise as large as the sysctl allows.
fn set_buffers(socket: &Socket) {
    if setsockopt(socket, sockopt::RcvBufForce, &SOCKET_BUFFER).is_err() {
        let _ = socket.set_recv_buffer_size(SOCKET_BUFFER);
    }
    if setsockopt(socket, sockopt::SndBufForce, &SOCKET_BUFFER).is_err() {
        let _ = socket.set_send_buffer_size(SOCKET_BUFFER);
    }
}

/// Sends one datagram without blocking.
pub fn send_nonblocking(socket: &UdpSocket, buf: &[u8], peer: SocketAddr) -> nix::Result<usize> {
    let addr = SockaddrStorage::from(peer);
    send_one(socket, buf, &addr, MsgFlags::MSG_DONTWAIT)
}

/// IPv4 answers are never fragmented by the kernel (`IP_PMTUDISC_PROBE`). By default the kernel
/// sets DF but may still fragment what it sends, so every answer takes an IP ID from a table the
/// whole host shares (`__ip_select_ident`: a hash, and an atomic add on a cache line that every
/// CPU's sends contend for), 4 % of a worker's CPU per cache hit. An answer it never fragments
/// is an atomic datagram and takes ID 0 (RFC 6864 §4.1). A UDP answer is at most
/// [`nodedns_wire::EDNS_UDP_SIZE`] bytes, small enough for any path, and the path MTU is
/// ignored, so an ICMP "fragmentation needed" (which could be forged) never lowers what the
/// socket sends. The kernel refuses an answer larger than its link's MTU (`EMSGSIZE`):
/// [`send_one`] then sends it fragmented. IPv6 has no ID in its header; its sockets are left as
/// they are.
fn forbid_fragments(socket: &UdpSocket, local: SocketAddr) {
    if !local.is_ipv4() {
        return;
    }
    if let Err(err) = set_ip_mtu_discover(socket, Ipv4PathMtuDiscovery::PROBE) {
        tracing::debug!(%local, %err, "cannot set DF on UDP answers");
    }
}

/// Sends one datagram; one that its link's MTU cannot carry with DF set goes fragmented
/// ([`send_fragmented`]).
fn send_one(
    socket: &UdpSocket,
    buf: &[u8],
    peer: &SockaddrStorage,
    flags: MsgFlags,
) -> nix::Result<usize> {
    match sendto(socket.as_raw_fd(), buf, peer, flags) {
        Err(Errno::EMSGSIZE) => send_fragmented(socket, buf, peer, flags),
        sent => sent,
    }
}

/// Sends one IPv4 datagram that the kernel refused with DF: the socket lets the kernel fragment
/// for this one send (`IP_PMTUDISC_OMIT`, fragments at the link's MTU, the path MTU still
/// ignored), then sets DF again. One lock for every socket: no other thread may set DF again
/// between the two steps; the datagrams that other threads send meanwhile without DF are only as
/// costly as they were before DF.
#[cold]
fn send_fragmented(
    socket: &UdpSocket,
    buf: &[u8],
    peer: &SockaddrStorage,
    flags: MsgFlags,
) -> nix::Result<usize> {
    static ONE_AT_A_TIME: std::sync::Mutex<()> = std::sync::Mutex::new(());
    if peer.as_sockaddr_in().is_none() {
        return Err(Errno::EMSGSIZE);
    }
    let _one = ONE_AT_A_TIME
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner);
    set_ip_mtu_discover(socket, Ipv4PathMtuDiscovery::OMIT)
        .map_err(|err| Errno::from_raw(err.raw_os_error()))?;
    let sent = sendto(socket.as_raw_fd(), buf, peer, flags);
    let _ = set_ip_mtu_discover(socket, Ipv4PathMtuDiscovery::PROBE);
    sent
}

/// What tells a worker to stop serving: a flag it reads between batches, and a signal that wakes
/// it while it waits on its reactor (its sender dropped stops the worker too).
#[derive(Debug, Clone)]
pub struct Stop {
    pub flag: Arc<AtomicBool>,
    pub signal: watch::Receiver<bool>,
}

impl Stop {
    fn requested(&self, shared: &Shared) -> bool {
        shared.stopping() || self.flag.load(Ordering::Acquire)
    }
}

/// Runs one worker until shutdown, or until `stop` (the socket was handed to another instance),
/// then answers its misses still in flight. `local` is the address the socket is bound to. A
/// batch that was read is always answered before the loop looks at either.
pub fn run(shared: Arc<Shared>, socket: Arc<UdpSocket>, local: SocketAddr, stop: Stop) {
    let runtime = match worker_runtime() {
        Ok(runtime) => runtime,
        Err(err) => {
            tracing::error!(%local, %err, "cannot start a UDP worker's runtime");
            return;
        }
    };
    forbid_fragments(&socket, local);
    if let Err(err) = nix::sys::prctl::set_timerslack(TIMER_SLACK_NS) {
        tracing::debug!(%local, %err, "cannot set the UDP worker's timer slack");
    }
    OUTBOX.with(|o| *o.borrow_mut() = Some(Outbox::new(shared.metrics.clone(), socket.clone())));
    runtime.block_on(serve(&shared, &socket, local, &stop));
    runtime.block_on(drain(DRAIN));
    // Whatever is still in flight now is dropped with the runtime; the waiters it leaves are
    // answered as it drops (`pipeline`), straight from this thread.
    OUTBOX.with(|o| *o.borrow_mut() = None);
    drop(runtime);
}

/// A worker's runtime: current-thread, pausing before it sleeps while many misses are in flight.
fn worker_runtime() -> io::Result<tokio::runtime::Runtime> {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .on_thread_park(pause_before_sleep)
        .build()
}

/// Runs when the worker's runtime has nothing to do and is about to sleep on its reactor: with
/// [`COALESCE_FROM`] tasks or more alive, sleeps [`COALESCE_PAUSE`] first, so that the events
/// arriving meanwhile wake the runtime once, together.
fn pause_before_sleep() {
    let alive = tokio::runtime::Handle::current()
        .metrics()
        .num_alive_tasks();
    if alive >= COALESCE_FROM {
        #[cfg(test)]
        PAUSES.with(|p| p.set(p.get() + 1));
        std::thread::sleep(COALESCE_PAUSE);
    }
}

#[cfg(test)]
thread_local! {
    /// The pauses this thread took ([`pause_before_sleep`]).
    static PAUSES: std::cell::Cell<u64> = const { std::cell::Cell::new(0) };
}

/// The serving loop of one worker (see the module's documentation).
async fn serve(shared: &Arc<Shared>, socket: &Arc<UdpSocket>, local: SocketAddr, stop: &Stop) {
    let counters = shared.metrics.worker(local);
    let clients = shared.clients.worker();
    let log = shared.querylog.single_writer();
    let to = Recorder {
        counters: &counters,
        clients: clients.as_deref(),
        log: &log,
    };
    let runtime = tokio::runtime::Handle::current();
    let tasks = runtime.metrics();
    let mut worker = Worker::new(&shared.udp_limit);
    let mut signal = stop.signal.clone();
    let mut registered: Option<AsyncFd<Arc<UdpSocket>>> = None;
    // When the last task ended, while registered.
    let mut idle_since: Option<Instant> = None;
    // How long the tasks' last round took: the reading's share of the next turn.
    let mut share = Duration::ZERO;
    while !stop.requested(shared) {
        let Some(fd) = &registered else {
            match worker.serve_batch(shared, &to, socket, local, &runtime, Wait::Block) {
                Ok(()) | Err(Errno::EAGAIN | Errno::EINTR) => {}
                Err(err) => {
                    counters.recv_failed();
                    tracing::warn!(%local, %err, "UDP receive failed");
                }
            }
            if tasks.num_alive_tasks() > 0 {
                match register(socket) {
                    Ok(fd) => registered = Some(fd),
                    Err(err) => {
                        tracing::warn!(%local, %err, "cannot register a UDP socket with its worker's reactor");
                    }
                }
                // The tasks started send their queries now.
                round().await;
            }
            continue;
        };
        let mut guard = tokio::select! {
            biased;
            changed = signal.changed() => {
                if changed.is_err() {
                    // The generation that started the worker is gone.
                    break;
                }
                continue;
            }
            ready = fd.readable() => match ready {
                Ok(guard) => guard,
                Err(err) => {
                    tracing::warn!(%local, %err, "UDP socket's readiness failed");
                    registered = None;
                    continue;
                }
            },
        };
        let turn_began = Instant::now();
        // The worker's turn: batches while datagrams are queued, for as long as the tasks' last
        // round took (at most MAX_TURN batches), so that under overload reading and resolving
        // share the thread as two threads would share a CPU.
        let before = tasks.num_alive_tasks();
        let mut batches = 0;
        let drained = loop {
            let asked = worker.want;
            let drained = match worker.serve_batch(shared, &to, socket, local, &runtime, Wait::No) {
                Ok(()) => worker.received.len() < asked,
                Err(Errno::EAGAIN) => true,
                Err(Errno::EINTR) => false,
                Err(err) => {
                    counters.recv_failed();
                    tracing::warn!(%local, %err, "UDP receive failed");
                    true
                }
            };
            batches += 1;
            let turn = worker.now.saturating_duration_since(turn_began);
            if drained || batches >= MAX_TURN || turn >= share {
                break drained;
            }
        };
        if drained {
            // All that was queued: a datagram arriving after the read raises a new event.
            guard.clear_ready();
        } else {
            drop(guard);
        }
        if !drained || tasks.num_alive_tasks() > before {
            let began = worker.now;
            round().await;
            share = began.elapsed();
        }
        if tasks.num_alive_tasks() > 0 {
            idle_since = None;
        } else {
            let now = worker.now;
            match idle_since {
                Some(since) if now.duration_since(since) >= LINGER => {
                    registered = None;
                    idle_since = None;
                }
                Some(_) => {}
                None => idle_since = Some(now),
            }
        }
    }
}

/// Waits until every task of the runtime that is ready now has run once: the turn of the
/// worker's loop among its misses. A task spawned now runs after them, and wakes the loop. So
/// under a flood, reading the next batch waits for the misses already read to move on (they send
/// their queries, or take their answers), and they never starve the reading either.
async fn round() {
    let mut queued = false;
    std::future::poll_fn(|cx| {
        if queued {
            return std::task::Poll::Ready(());
        }
        queued = true;
        let waker = cx.waker().clone();
        tokio::spawn(async move { waker.wake() });
        std::task::Poll::Pending
    })
    .await;
}

/// Runs the worker's runtime until no task is alive on it, `limit` at most.
async fn drain(limit: Duration) {
    let tasks = tokio::runtime::Handle::current().metrics();
    let deadline = tokio::time::Instant::now() + limit;
    while tasks.num_alive_tasks() > 0 && tokio::time::Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

/// Registers `socket` with the current runtime's reactor, for readability. The socket stays
/// blocking (the reads that must not wait say so with `MSG_DONTWAIT`), so that the worker can
/// go back to its blocking wait once it is withdrawn.
#[allow(unsafe_code)]
fn register(socket: &Arc<UdpSocket>) -> io::Result<AsyncFd<Arc<UdpSocket>>> {
    // SAFETY: the `AsyncFd` owns a reference to the socket, so its descriptor stays open and
    // names the same socket until the `AsyncFd` is dropped; `UdpSocket::as_raw_fd` always
    // returns that descriptor.
    unsafe { AsyncFd::register_with_interest(socket.clone(), Interest::READABLE) }
        .map_err(|err| err.into_parts().1)
}

/// How a batch's `recvmmsg` waits.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Wait {
    /// Until a datagram arrives (or the socket's receive timeout).
    Block,
    /// Not at all: what is queued, or `EAGAIN`.
    No,
}

/// Answers from the tasks of a worker's runtime to its socket, sent together: the first one
/// queued starts a task ([`flush_soon`]), which runs after the tasks already woken in the same
/// turn and after those that the reactor's next look wakes, and sends what they queued in one
/// `sendmmsg`. One per worker thread.
struct Outbox {
    /// Where a failed send is counted.
    metrics: Arc<Metrics>,
    /// The worker's socket.
    socket: Arc<UdpSocket>,
    /// The answers queued, and their clients.
    answers: Vec<Vec<u8>>,
    peers: Vec<Option<SockaddrStorage>>,
    /// A flush task is scheduled.
    flushing: bool,
    headers: MultiHeaders<SockaddrStorage>,
    /// Kept empty between flushes (see [`recycle`]).
    iovs: Vec<[IoSlice<'static>; 1]>,
}

thread_local! {
    /// The worker thread's outbox; `None` on every other thread.
    static OUTBOX: RefCell<Option<Outbox>> = const { RefCell::new(None) };
}

impl Outbox {
    fn new(metrics: Arc<Metrics>, socket: Arc<UdpSocket>) -> Self {
        Outbox {
            metrics,
            socket,
            answers: Vec::new(),
            peers: Vec::new(),
            flushing: false,
            headers: MultiHeaders::preallocate(BATCH, None),
            iovs: Vec::new(),
        }
    }
}

/// Sends the answer `out` to `peer` out of `socket`: through this thread's outbox when this is
/// the socket's worker thread (a miss's task of its runtime), otherwise at once. Never blocks;
/// false when it could not be sent at once (a full socket buffer: dropped, as the kernel would
/// have dropped the query).
pub fn send(socket: &UdpSocket, out: Vec<u8>, peer: SocketAddr) -> bool {
    let fd = socket.as_raw_fd();
    let queued = OUTBOX.with(|outbox| {
        let mut outbox = outbox.borrow_mut();
        let Some(outbox) = outbox.as_mut().filter(|o| o.socket.as_raw_fd() == fd) else {
            return Err(out);
        };
        outbox.answers.push(out);
        outbox.peers.push(Some(SockaddrStorage::from(peer)));
        if !outbox.flushing {
            outbox.flushing = true;
            tokio::spawn(flush_soon());
        }
        Ok(())
    });
    match queued {
        Ok(()) => true,
        Err(out) => send_nonblocking(socket, &out, peer).is_ok(),
    }
}

/// The flush task: while other tasks are alive (misses in flight, whose replies may be arriving
/// now), lets the runtime look for events once more (`yield_now` is woken after the reactor's
/// next poll, and after the tasks that poll wakes), then sends what the outbox holds. So a burst
/// of upstream replies that is still arriving while the first of them are answered leaves in one
/// `sendmmsg`, not in several: the client wakes once for it, not once per part. The last answer
/// pending leaves at once.
async fn flush_soon() {
    if tokio::runtime::Handle::current()
        .metrics()
        .num_alive_tasks()
        > 1
    {
        tokio::task::yield_now().await;
    }
    flush();
}

/// Sends what this thread's outbox holds.
fn flush() {
    OUTBOX.with(|outbox| {
        let mut outbox = outbox.borrow_mut();
        let Some(outbox) = outbox.as_mut() else {
            return;
        };
        outbox.flushing = false;
        let mut iovs = recycle(std::mem::take(&mut outbox.iovs));
        iovs.extend(outbox.answers.iter().map(|a| [IoSlice::new(a)]));
        let failed = send_all(&outbox.socket, &mut outbox.headers, &iovs, &outbox.peers);
        outbox.iovs = recycle(iovs);
        outbox.answers.clear();
        outbox.peers.clear();
        for _ in 0..failed {
            outbox.metrics.counters().send_failed();
        }
    });
}

/// Sends each datagram of `iovs` to its peer, in as few `sendmmsg` calls as the kernel takes
/// them; returns how many failed (skipped: an unreachable peer, a full buffer).
fn send_all(
    socket: &UdpSocket,
    headers: &mut MultiHeaders<SockaddrStorage>,
    iovs: &[[IoSlice<'_>; 1]],
    peers: &[Option<SockaddrStorage>],
) -> usize {
    let (mut done, mut failed) = (0, 0);
    while done < iovs.len() {
        let end = iovs.len().min(done + BATCH);
        match sendmmsg(
            socket.as_raw_fd(),
            headers,
            &iovs[done..end],
            &peers[done..end],
            [],
            MsgFlags::empty(),
        ) {
            Ok(results) => {
                // A short count means the next datagram failed; the next call reports its
                // error.
                let sent = results.count();
                if sent == 0 {
                    failed += 1;
                    done += 1;
                }
                done += sent;
            }
            Err(Errno::EINTR) => {}
            Err(err) => {
                // The first datagram of the rest failed: one too large for DF goes fragmented,
                // any other (e.g. to an unreachable peer) is skipped.
                let sent = err == Errno::EMSGSIZE
                    && peers[done].as_ref().is_some_and(|peer| {
                        send_fragmented(socket, &iovs[done][0], peer, MsgFlags::empty()).is_ok()
                    });
                if !sent {
                    failed += 1;
                }
                done += 1;
            }
        }
    }
    failed
}

/// One worker's reusable buffers. Nothing is allocated per batch: the send side's I/O vectors
/// borrow the buffers, so they are kept as an empty vector between batches and refilled in place
/// ([`recycle`]).
struct Worker {
    inbuf: Vec<[u8; MAX_QUERY]>,
    outbuf: Vec<Vec<u8>>,
    recv_headers: MultiHeaders<SockaddrStorage>,
    send_headers: MultiHeaders<SockaddrStorage>,
    /// Length of each datagram of the current batch.
    received: Vec<usize>,
    /// Peer of each datagram of the current batch.
    sources: Vec<Option<SockaddrStorage>>,
    /// Slot of each answer of the current batch.
    answers: Vec<usize>,
    /// Peers of the answers, in order (what `sendmmsg` takes), when some datagram of the batch
    /// got no answer; otherwise `sources` is that list.
    peers: Vec<Option<SockaddrStorage>>,
    send_iovs: Vec<[IoSlice<'static>; 1]>,
    /// Datagrams asked of the next `recvmmsg`: twice the last batch, so a lightly loaded worker
    /// does not set up a full batch of headers for every datagram, and a busy one grows to
    /// [`BATCH`].
    want: usize,
    /// The time the rate limit reads, per batch.
    clock: Clock,
    /// When the last batch was read.
    now: Instant,
}

/// Reuses a vector's allocation for another element type of the same size and alignment (here the
/// same I/O vector type, with the lifetime of this batch's buffers). The standard library collects
/// `into_iter().map(..)` in place, keeping the capacity.
fn recycle<T, U>(mut v: Vec<T>) -> Vec<U> {
    v.clear();
    v.into_iter()
        .map(|_| unreachable!("the vector was cleared"))
        .collect()
}

impl Worker {
    fn new(limiter: &Limiter) -> Self {
        Worker {
            inbuf: vec![[0; MAX_QUERY]; BATCH],
            outbuf: (0..BATCH).map(|_| Vec::with_capacity(1232)).collect(),
            recv_headers: MultiHeaders::preallocate(BATCH, None),
            send_headers: MultiHeaders::preallocate(BATCH, None),
            received: Vec::with_capacity(BATCH),
            sources: Vec::with_capacity(BATCH),
            answers: Vec::with_capacity(BATCH),
            peers: Vec::with_capacity(BATCH),
            send_iovs: Vec::with_capacity(BATCH),
            want: MIN_WANT,
            clock: limiter.clock(),
            now: Instant::now(),
        }
    }

    fn serve_batch(
        &mut self,
        shared: &Arc<Shared>,
        to: &Recorder<'_>,
        socket: &Arc<UdpSocket>,
        local: SocketAddr,
        runtime: &tokio::runtime::Handle,
        wait: Wait,
    ) -> Result<(), Errno> {
        let fd = socket.as_raw_fd();
        let flags = match wait {
            Wait::Block => MsgFlags::MSG_WAITFORONE,
            Wait::No => MsgFlags::MSG_DONTWAIT,
        };
        if self.want <= MIN_WANT {
            self.receive::<MIN_WANT>(fd, flags)?;
        } else {
            self.receive::<BATCH>(fd, flags)?;
        }
        self.want = (self.received.len() * 2).clamp(MIN_WANT, BATCH);
        let now = Instant::now();
        self.now = now;
        let clock = self.clock.read(&shared.udp_limit, now);
        let snap = shared.snapshot.load();
        self.answers.clear();
        for (slot, (&len, peer)) in self.received.iter().zip(&self.sources).enumerate() {
            let Some(peer_addr) = peer.as_ref().and_then(to_socket_addr) else {
                continue;
            };
            if forbidden(&peer_addr) {
                to.counters.forbidden_source();
                continue;
            }
            let packet = &self.inbuf[slot][..len];
            let out = &mut self.outbuf[slot];
            out.clear();
            let verdict = shared.udp_limit.check(&peer_addr, clock);
            if verdict != Verdict::Answer {
                if limited(to.counters, verdict, packet, out) {
                    self.answers.push(slot);
                }
                continue;
            }
            let client = Client {
                proto: Proto::Udp,
                addr: peer_addr,
            };
            match pipeline::answer(to, &snap, packet, local, &client, now, out) {
                Front::Answered => self.answers.push(slot),
                Front::Dropped => {}
                Front::AnsweredRefresh(refresh) => {
                    self.answers.push(slot);
                    pipeline::refresh(shared, runtime, refresh);
                }
                Front::Miss(mut miss) => match shared.track(pipeline::MAX_PENDING) {
                    Some(in_flight) => {
                        let waiter = miss.waiter(packet, ReplyTo::Udp(socket.clone()), client, now);
                        pipeline::spawn_tracked(shared, runtime, miss, waiter, in_flight);
                    }
                    None => {
                        pipeline::refused_for_load(to, &miss, packet, &client, out);
                        self.answers.push(slot);
                    }
                },
            }
        }
        self.send_answers(socket, to.counters);
        Ok(())
    }

    /// Takes up to `N` datagrams into `received`; `flags` say whether to block until there is
    /// one.
    ///
    /// nix ties the I/O vectors' borrow to the results', so they cannot be recycled like the send
    /// side's; they are a stack array of `N`, set up per call, so a lightly loaded worker
    /// (`N` = [`MIN_WANT`]) does not pay for a full batch.
    fn receive<const N: usize>(&mut self, fd: i32, flags: MsgFlags) -> Result<(), Errno> {
        self.received.clear();
        self.sources.clear();
        let mut bufs = self.inbuf.iter_mut();
        let mut iovs: [[IoSliceMut<'_>; 1]; N] = std::array::from_fn(|_| {
            [IoSliceMut::new(
                bufs.next().map_or(&mut [][..], |b| &mut b[..]),
            )]
        });
        let results = recvmmsg(fd, &mut self.recv_headers, iovs.iter_mut(), flags, None)?;
        for msg in results {
            // A datagram longer than the buffer was cut by the kernel: parse nothing.
            let len = if msg.flags.contains(MsgFlags::MSG_TRUNC) {
                0
            } else {
                msg.bytes
            };
            self.received.push(len);
            self.sources.push(msg.address);
        }
        Ok(())
    }

    fn send_answers(&mut self, socket: &UdpSocket, counters: &Counters) {
        if let [slot] = self.answers[..] {
            // One answer (the common case below saturation): a plain sendto.
            if let Some(peer) = &self.sources[slot] {
                if send_one(socket, &self.outbuf[slot], peer, MsgFlags::empty()).is_err() {
                    counters.send_failed();
                }
            }
            return;
        }
        // Answers go in the order of their slots, so as many answers as datagrams means every
        // datagram has one, and the batch's sources are their peers as they are.
        let peers = if self.answers.len() == self.sources.len() {
            &self.sources
        } else {
            self.peers.clear();
            self.peers
                .extend(self.answers.iter().map(|&slot| self.sources[slot]));
            &self.peers
        };
        let mut iovs = recycle(std::mem::take(&mut self.send_iovs));
        iovs.extend(
            self.answers
                .iter()
                .map(|&slot| [IoSlice::new(&self.outbuf[slot])]),
        );
        for _ in 0..send_all(socket, &mut self.send_headers, &iovs, peers) {
            counters.send_failed();
        }
        self.send_iovs = recycle(iovs);
    }
}

/// Whether no answer may go to `peer`: port 0, an unspecified address, a broadcast or multicast
/// one. Such a source is forged (the kernel never gives a socket one to send from, RFC 1122
/// §3.2.1.3 and RFC 4291 §2.7 forbid them as sources), and an answer would go to a bystander, a
/// whole network, or back to the node itself: a reflection. (A subnet's directed broadcast
/// address cannot be told from a host's here; the kernel refuses to send to one without
/// `SO_BROADCAST`, which the listeners never set.)
#[inline]
fn forbidden(peer: &SocketAddr) -> bool {
    peer.port() == 0
        || match peer.ip() {
            IpAddr::V4(ip) => ip.is_unspecified() || ip.is_multicast() || ip.is_broadcast(),
            IpAddr::V6(ip) => ip.is_unspecified() || ip.is_multicast(),
        }
}

/// A query beyond its client's rate limit: writes an empty TC=1 answer into `out` for
/// [`Verdict::Truncate`] (`true`: send it), nothing for [`Verdict::Drop`]; counts which. A
/// packet that does not parse as a query gets nothing (counted as dropped).
#[cold]
fn limited(counters: &Counters, verdict: Verdict, packet: &[u8], out: &mut Vec<u8>) -> bool {
    let truncated = verdict == Verdict::Truncate
        && nodedns_wire::Query::parse(packet).is_ok_and(|query| {
            nodedns_wire::write_truncated(&query, out);
            true
        });
    counters.rate_limited(truncated);
    truncated
}

fn to_socket_addr(addr: &SockaddrStorage) -> Option<SocketAddr> {
    if let Some(v4) = addr.as_sockaddr_in() {
        return Some(SocketAddr::V4((*v4).into()));
    }
    addr.as_sockaddr_in6()
        .map(|v6| SocketAddr::V6((*v6).into()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sources_no_answer_may_go_to_are_forbidden() {
        for peer in [
            "10.0.0.1:0",
            "0.0.0.0:5353",
            "255.255.255.255:68",
            "224.0.0.251:5353",
            "239.255.255.250:1900",
            "[::]:5353",
            "[ff02::fb]:5353",
        ] {
            assert!(forbidden(&peer.parse().unwrap()), "{peer}");
        }
        for peer in [
            "10.244.1.7:40000",
            "127.0.0.1:53000",
            "169.254.20.10:1",
            "[fd00::7]:40000",
            "[::1]:53000",
        ] {
            assert!(!forbidden(&peer.parse().unwrap()), "{peer}");
        }
    }

    /// A worker's runtime, its socket with this thread's outbox, and a client socket that
    /// reads without blocking.
    fn worker_with_outbox() -> (tokio::runtime::Runtime, Arc<UdpSocket>, Arc<UdpSocket>) {
        let runtime = worker_runtime().unwrap();
        let server = Arc::new(UdpSocket::bind("127.0.0.1:0").unwrap());
        let client = Arc::new(UdpSocket::bind("127.0.0.1:0").unwrap());
        client.set_nonblocking(true).unwrap();
        let metrics = Arc::new(Metrics::new(&[server.local_addr().unwrap()], true));
        OUTBOX.with(|o| *o.borrow_mut() = Some(Outbox::new(metrics, server.clone())));
        (runtime, server, client)
    }

    /// The first answer queued waits for the tasks that the reactor's next look wakes (here, a
    /// reply that reached an upstream socket meanwhile): the reply's answer leaves with it, in
    /// one `sendmmsg`, not in one of its own just after.
    #[test]
    fn the_outbox_sends_after_the_replies_that_arrived_meanwhile() {
        let (runtime, server, client) = worker_with_outbox();
        let to = client.local_addr().unwrap();
        let sent_before_the_reply = runtime.block_on(async {
            let upstream = tokio::net::UdpSocket::bind("127.0.0.1:0").await.unwrap();
            let upstream_addr = upstream.local_addr().unwrap();
            let (server_, client_) = (server.clone(), client.clone());
            let replied = tokio::spawn(async move {
                upstream.recv(&mut [0; 16]).await.unwrap();
                let already = client_.recv(&mut [0; 16]).is_ok();
                assert!(send(&server_, b"second".to_vec(), to));
                already
            });
            let server_ = server.clone();
            let first = tokio::spawn(async move {
                let replier = UdpSocket::bind("127.0.0.1:0").unwrap();
                replier.send_to(b"reply", upstream_addr).unwrap();
                assert!(send(&server_, b"first".to_vec(), to));
            });
            first.await.unwrap();
            replied.await.unwrap()
        });
        OUTBOX.with(|o| *o.borrow_mut() = None);
        assert!(
            !sent_before_the_reply,
            "the first answer left before the reply's task ran"
        );
        client.set_nonblocking(false).unwrap();
        client
            .set_read_timeout(Some(Duration::from_secs(5)))
            .unwrap();
        let mut buf = [0; 16];
        for expected in [&b"first"[..], b"second"] {
            let n = client.recv(&mut buf).unwrap();
            assert_eq!(&buf[..n], expected);
        }
    }

    /// With nothing else alive on the runtime (no miss in flight), the answer queued leaves in
    /// the flush task's first run, before the runtime looks for events again.
    #[test]
    fn the_last_answer_pending_leaves_at_once() {
        let (runtime, server, client) = worker_with_outbox();
        let to = client.local_addr().unwrap();
        let mut buf = [0; 16];
        let received = runtime.block_on(async {
            assert!(send(&server, b"only".to_vec(), to));
            // Woken after the runtime's next look for events: the flush task has run by then.
            tokio::task::yield_now().await;
            client.recv(&mut buf)
        });
        OUTBOX.with(|o| *o.borrow_mut() = None);
        let n = received.expect("the answer should have left before the runtime looked for events");
        assert_eq!(&buf[..n], b"only");
    }

    /// A worker's runtime that finds nothing to do pauses before it sleeps with
    /// [`COALESCE_FROM`] tasks alive (misses waiting for their replies), and sleeps at once with
    /// one fewer.
    #[test]
    fn a_worker_pauses_before_it_sleeps_only_with_many_misses_in_flight() {
        for (alive, paused) in [
            (0, false),
            (COALESCE_FROM - 1, false),
            (COALESCE_FROM, true),
        ] {
            let runtime = worker_runtime().unwrap();
            let before = PAUSES.with(|p| p.get());
            runtime.block_on(async {
                for _ in 0..alive {
                    tokio::spawn(std::future::pending::<()>());
                }
                // Nothing else is ready: the runtime sleeps on its reactor until the timer.
                tokio::time::sleep(Duration::from_millis(1)).await;
            });
            let pauses = PAUSES.with(|p| p.get()) - before;
            assert_eq!(pauses > 0, paused, "{alive} tasks alive: {pauses} pauses");
        }
    }

    /// Each answer of a batch goes to the peer of its own datagram: when every datagram has an
    /// answer (the batch's sources are sent as they are) and when some have none.
    #[test]
    fn each_answer_of_a_batch_goes_to_the_peer_its_datagram_came_from() {
        let server = UdpSocket::bind("127.0.0.1:0").unwrap();
        let clients: Vec<UdpSocket> = (0..3)
            .map(|_| {
                let c = UdpSocket::bind("127.0.0.1:0").unwrap();
                c.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
                c
            })
            .collect();
        let metrics = Metrics::new(&[server.local_addr().unwrap()], true);
        let mut worker = Worker::new(&Limiter::new(super::super::ratelimit::Settings::default()));
        for answered in [vec![0, 1, 2], vec![0, 2], vec![1]] {
            worker.received.clear();
            worker.sources.clear();
            worker.answers.clear();
            for (slot, client) in clients.iter().enumerate() {
                worker.received.push(12);
                let peer = SockaddrStorage::from(client.local_addr().unwrap());
                worker.sources.push(Some(peer));
                worker.outbuf[slot] = vec![slot as u8; 12];
            }
            worker.answers.extend(&answered);
            worker.send_answers(&server, metrics.counters());
            for (slot, client) in clients.iter().enumerate() {
                if !answered.contains(&slot) {
                    continue;
                }
                let mut buf = [0; 64];
                let n = client.recv(&mut buf).unwrap();
                assert_eq!(&buf[..n], &[slot as u8; 12], "answers {answered:?}");
            }
            for client in &clients {
                client.set_nonblocking(true).unwrap();
                let mut buf = [0; 64];
                assert!(
                    client.recv(&mut buf).is_err(),
                    "answers {answered:?}: one too many"
                );
                client.set_nonblocking(false).unwrap();
            }
        }
    }

    #[test]
    fn recycle_keeps_the_allocation() {
        let empty: Vec<[IoSlice<'static>; 1]> = Vec::with_capacity(BATCH);
        let capacity = empty.capacity();
        let buf = [0u8; 4];
        let mut batch: Vec<[IoSlice<'_>; 1]> = recycle(empty);
        batch.push([IoSlice::new(&buf)]);
        let back: Vec<[IoSlice<'static>; 1]> = recycle(batch);
        assert_eq!(back.capacity(), capacity);
        assert!(back.is_empty());
    }
}
