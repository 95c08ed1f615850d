//! Connections to one upstream address: TCP in production, whatever the pool's [`Dial`] opens.
//!
//! CoreDNS reads a connection's next query only after answering the previous one, so a
//! connection carries one query at a time and concurrency needs several connections. The pool:
//! - caps connections at `max_connections` with a semaphore whose permits are *slots*: a query
//!   takes a slot first (waiting when all are busy), then reuses an idle connection or dials
//!   one. Idle connections hold no slot; a dial that would take the open connections past the
//!   cap first closes the oldest idle one, so open connections never exceed it.
//! - uses a connection only on the runtime whose reactor watches its socket (that reactor alone
//!   learns that a reply arrived): a query takes the newest idle connection of its own runtime,
//!   else another runtime's, whose socket then moves to this runtime's reactor (two
//!   `epoll_ctl` calls, not a new connection; a TLS connection cannot move and is closed). The
//!   agent serves each UDP socket on a runtime of its own, whose misses never wait on another
//!   thread, and its runtimes share one cap and one set of connections.
//! - waits without timers of its own: the caller bounds every wait (slot, dial, reply) by
//!   dropping the future, which closes whatever connection it held. One query then costs one
//!   timer, the group's, however many steps it has.
//! - can hand out only a *proven* connection ([`Pick::AnsweredAfter`]): one that answered after
//!   a given moment, else a new one. A query hedged because its connection went silent must not
//!   land on an idle connection that may share the silent one's fate (behind a ClusterIP, the
//!   same dead endpoint: nothing on our side of the NAT tells them apart).
//! - keeps idle connections on a LIFO stack: a trickle of sequential misses keeps reusing the
//!   newest connection while the others age out; the oldest sit at the bottom, which is where the
//!   reaper looks.
//! - closes idle connections after `expire` with one reaper task that sleeps until the oldest
//!   one's expiry (no polling), because CoreDNS closes a connection after 10 s idle and a query
//!   written into a connection the server is closing is lost.
//! - hands a connection out as a [`Lease`]; only [`Lease::release`] after a complete, validated
//!   exchange returns it to the stack. A lease dropped any other way (error, timeout, the caller's
//!   future dropped mid-query) closes the connection, so a late reply can never be read by the
//!   next query. Nor is a connection pooled with bytes left after its reply, or reused when the
//!   peer closed it or sent something while it was idle ([`Dial::usable`]).
//! - reads replies through `nodedns_wire::frame::Buffer`, one per connection: usually one read
//!   per reply, and no allocation but the reply's own.

use std::fmt;
use std::io;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::Duration;

use nodedns_wire::frame;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tokio::runtime::{Handle, Id};
use tokio::sync::{Notify, Semaphore, SemaphorePermit};
use tokio::time::{Instant, sleep_until, timeout_at};

use crate::dial::Dial;
use crate::metrics::{Held, Target};
use crate::msg::Check;

/// Room a connection's read buffer starts with: most replies fit. A reply that does not grows
/// the buffer for that connection; past [`KEEP_BUFFER`] it is given back when the connection
/// goes idle, so a pool holds no large buffers for long.
const BUFFER: usize = 512;
const KEEP_BUFFER: usize = 4096;

/// Why one exchange with one upstream address failed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Fault {
    /// No connection could be made (refused, unreachable), or a UDP send drew an ICMP error.
    Refused,
    /// The connection was closed or reset with the query in flight.
    Closed,
    /// No reply within the read timeout (decided by the caller, which drops the exchange).
    Timeout,
    /// A reply arrived that does not answer the query (wrong ID or question, not a response).
    BadReply,
}

impl Fault {
    /// Whether the fault says something about the upstream's health (`max_fails`).
    pub(crate) fn counts_against_upstream(self) -> bool {
        matches!(self, Fault::Refused | Fault::Closed | Fault::Timeout)
    }
}

pub(crate) struct Pool<D: Dial> {
    addr: SocketAddr,
    expire: Duration,
    /// Opens the connections (shared by the pools of one group).
    dial: Arc<D>,
    /// Open connections at most (the slots' number).
    max_connections: usize,
    /// One permit per connection in use.
    slots: Semaphore,
    /// Idle connections, oldest first; taken from and returned to the end. The connections of
    /// every runtime share it: one expiry order, one cap.
    idle: Mutex<Vec<Idle<D::Conn>>>,
    /// Wakes the reaper when the stack was empty and a connection went idle.
    went_idle: Notify,
    metrics: Arc<Target>,
}

struct Idle<S> {
    conn: Conn<S>,
    since: Instant,
}

/// One open connection and what has been read from it. Closing it is dropping it.
pub(crate) struct Conn<S> {
    stream: S,
    /// The runtime that opened it (and whose reactor watches its socket): the only one that may
    /// use it.
    home: Id,
    /// Bytes read and not yet taken as a reply. Empty whenever the connection is idle: bytes
    /// left after a reply make it unusable.
    frames: frame::Buffer,
    /// The framed query being written, its room kept for the next exchange.
    out: Vec<u8>,
    /// Keeps `nodedns_upstream_connections` up while the connection is open.
    _open: Held,
}

/// A connection checked out of the pool, with its slot.
pub(crate) struct Lease<'a, D: Dial> {
    pool: &'a Pool<D>,
    conn: Conn<D::Conn>,
    /// When the connection's last reply arrived, if it came from the idle stack (so a failure
    /// may just mean the server closed it); `None` for a new one.
    answered: Option<Instant>,
    _slot: SemaphorePermit<'a>,
}

/// Which connection a lease gets.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Pick {
    /// The newest idle connection, else a new one.
    Newest,
    /// An idle connection that answered after this moment, else a new one (never an older idle
    /// one).
    AnsweredAfter(Instant),
}

impl<D: Dial> Pool<D> {
    pub(crate) fn new(
        addr: SocketAddr,
        max_connections: usize,
        expire: Duration,
        dial: Arc<D>,
        metrics: Arc<Target>,
    ) -> Self {
        let max_connections = max_connections.min(Semaphore::MAX_PERMITS);
        Pool {
            addr,
            expire,
            dial,
            max_connections,
            slots: Semaphore::new(max_connections),
            idle: Mutex::new(Vec::new()),
            went_idle: Notify::new(),
            metrics,
        }
    }

    fn idle(&self) -> MutexGuard<'_, Vec<Idle<D::Conn>>> {
        // Nothing panics while holding the lock; if something ever did, the stack is still valid.
        self.idle.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Waits for a free slot (one connection in use), as long as the caller lets it; says
    /// whether it had to wait. `None` only if the semaphore were closed, which this pool never
    /// does.
    pub(crate) async fn slot(&self) -> Option<(SemaphorePermit<'_>, bool)> {
        if let Ok(slot) = self.slots.try_acquire() {
            return Some((slot, false));
        }
        self.slots.acquire().await.ok().map(|slot| (slot, true))
    }

    /// With a slot, an idle connection of this runtime as `pick` says, or a new one.
    pub(crate) async fn lease<'a>(
        &'a self,
        slot: SemaphorePermit<'a>,
        pick: Pick,
    ) -> Result<Lease<'a, D>, Fault> {
        let home = Handle::current().id();
        if let Some((conn, answered)) = self.take_idle(pick, home) {
            self.metrics.tcp_hits.inc();
            return Ok(Lease {
                pool: self,
                conn,
                answered: Some(answered),
                _slot: slot,
            });
        }
        let conn = self.dial().await?;
        Ok(Lease {
            pool: self,
            conn,
            answered: None,
            _slot: slot,
        })
    }

    /// Takes idle connections until one is neither expired nor closed by the peer, and is one
    /// `pick` accepts: the newest of runtime `home`, else the newest of another runtime that can
    /// move, moved to `home` ([`Dial::rehome`]). Returns it with the time of its last reply. The
    /// stack is in the order the connections answered, so when the newest did not answer after
    /// the moment asked for, none did.
    fn take_idle(&self, pick: Pick, home: Id) -> Option<(Conn<D::Conn>, Instant)> {
        let now = Instant::now();
        loop {
            let mut idle = {
                let mut stack = self.idle();
                let fits = |at: &usize| match pick {
                    Pick::Newest => true,
                    Pick::AnsweredAfter(t) => stack[*at].since > t,
                };
                // Another runtime's connection only when this one has none that fits.
                let at = stack
                    .iter()
                    .rposition(|i| i.conn.home == home)
                    .filter(fits)
                    .or_else(|| {
                        stack
                            .iter()
                            .rposition(|i| i.conn.home != home && self.dial.movable(&i.conn.stream))
                            .filter(fits)
                    })?;
                stack.remove(at)
            };
            if now >= idle.since + self.expire || !self.dial.usable(&mut idle.conn.stream) {
                // Dropped here, outside the lock: closed.
                continue;
            }
            if idle.conn.home != home {
                let Conn {
                    stream,
                    frames,
                    out,
                    _open,
                    ..
                } = idle.conn;
                let Some(stream) = self.dial.rehome(stream) else {
                    continue;
                };
                self.metrics.moves.inc();
                idle.conn = Conn {
                    stream,
                    home,
                    frames,
                    out,
                    _open,
                };
            }
            return Some((idle.conn, idle.since));
        }
    }

    /// Before a dial, with its slot: closes the oldest idle connections (another runtime's, or
    /// ones `pick` passed over) while the open ones would otherwise exceed the cap.
    fn make_room(&self) {
        let in_use = self.max_connections - self.slots.available_permits();
        let closed: Vec<Idle<D::Conn>> = {
            let mut idle = self.idle();
            let over = (in_use + idle.len()).saturating_sub(self.max_connections);
            let over = over.min(idle.len());
            idle.drain(..over).collect()
        };
        // Dropped here, outside the lock: closed.
        drop(closed);
    }

    /// Opens a connection for the pool (counted in the pool's metrics), on the caller's runtime.
    async fn dial(&self) -> Result<Conn<D::Conn>, Fault> {
        self.make_room();
        self.metrics.tcp_misses.inc();
        // Boxed: a TLS handshake's future holds the session's state (kilobytes), and inline it
        // would sit in the task of every query, which nearly always takes an idle connection.
        let stream = Box::pin(self.connect()).await?;
        self.metrics.connects.inc();
        Ok(Conn {
            stream,
            home: Handle::current().id(),
            frames: frame::Buffer::new(BUFFER),
            out: Vec::new(),
            _open: Held::new(&self.metrics.connections),
        })
    }

    async fn connect(&self) -> Result<D::Conn, Fault> {
        self.dial.dial(self.addr).await.map_err(|e| {
            tracing::debug!(upstream = %self.addr, error = %e, "connect failed");
            Fault::Refused
        })
    }

    fn put(&self, mut conn: Conn<D::Conn>) {
        if !conn.frames.is_empty() {
            // Bytes after the reply: nothing the next query could trust. Closed.
            return;
        }
        if conn.frames.capacity() > KEEP_BUFFER {
            conn.frames = frame::Buffer::new(BUFFER);
        }
        let mut idle = self.idle();
        let was_empty = idle.is_empty();
        idle.push(Idle {
            conn,
            since: Instant::now(),
        });
        drop(idle);
        if was_empty {
            // Otherwise the reaper is already sleeping until an older connection's expiry.
            self.went_idle.notify_one();
        }
    }

    /// Closes idle connections `expire` after they went idle. Runs until aborted.
    pub(crate) async fn reap(&self) {
        loop {
            let next = {
                let now = Instant::now();
                let mut idle = self.idle();
                let expired = idle
                    .iter()
                    .take_while(|i| i.since + self.expire <= now)
                    .count();
                let closed: Vec<Idle<D::Conn>> = idle.drain(..expired).collect();
                let next = idle.first().map(|i| i.since + self.expire);
                drop(idle);
                drop(closed);
                next
            };
            match next {
                Some(at) => sleep_until(at).await,
                None => self.went_idle.notified().await,
            }
        }
    }

    /// One exchange on a connection of its own, not counted in the pool's metrics (health
    /// checks: they must not depend on, or disturb, the pool of an address that is misbehaving).
    pub(crate) async fn exchange_once(
        &self,
        msg: &[u8],
        check: Check<'_>,
        deadline: Instant,
    ) -> Result<Vec<u8>, Fault> {
        let once = async {
            let mut stream = self.connect().await?;
            let mut frames = frame::Buffer::new(BUFFER);
            let id = rand::random();
            let framed = crate::msg::framed(msg, id);
            exchange(&mut stream, &mut frames, &framed, check, id).await
        };
        timeout_at(deadline, once)
            .await
            .unwrap_or(Err(Fault::Timeout))
    }

    /// Idle connections right now (tests).
    #[cfg(test)]
    pub(crate) fn idle_count(&self) -> usize {
        self.idle().len()
    }
}

impl<D: Dial> fmt::Debug for Pool<D> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Pool")
            .field("addr", &self.addr)
            .field("expire", &self.expire)
            .field("idle", &self.idle().len())
            .field("free_slots", &self.slots.available_permits())
            .finish_non_exhaustive()
    }
}

impl<D: Dial> Lease<'_, D> {
    /// When the connection last answered, if it came from the idle stack.
    pub(crate) fn answered(&self) -> Option<Instant> {
        self.answered
    }

    /// Sends `query` (a random ID per exchange) and returns the accepted reply; waits as long
    /// as the caller lets it. A reused connection that turns out closed is replaced at once by
    /// a fresh one, without counting against the upstream: the server may have closed it just
    /// before the write.
    pub(crate) async fn exchange(&mut self, query: &[u8]) -> Result<Vec<u8>, Fault> {
        loop {
            let id = rand::random();
            let conn = &mut self.conn;
            crate::msg::frame_into(&mut conn.out, query, id);
            match exchange(
                &mut conn.stream,
                &mut conn.frames,
                &conn.out,
                Check::Answer(query),
                id,
            )
            .await
            {
                Err(Fault::Closed) if self.answered.is_some() => {
                    self.pool.metrics.resets.inc();
                    self.pool.metrics.retries.inc();
                    tracing::debug!(upstream = %self.pool.addr, "reused connection closed, retrying on a new one");
                    self.conn = self.pool.dial().await?;
                    self.answered = None;
                }
                Err(Fault::Closed) => {
                    self.pool.metrics.resets.inc();
                    return Err(Fault::Closed);
                }
                other => return other,
            }
        }
    }

    /// Returns the connection to the idle stack. Only after a complete exchange.
    pub(crate) fn release(self) {
        let Lease {
            pool, conn, _slot, ..
        } = self;
        pool.put(conn);
        // `_slot` drops last: a waiter woken by it finds the connection idle.
    }
}

/// Writes `framed` (length prefix included) and reads one reply, accepted by `check` for `id`.
/// The reply is cut from the stream by `nodedns_wire::frame`, as the agent's client connections
/// are. No timer: the caller bounds it.
async fn exchange<S: AsyncRead + AsyncWrite + Unpin>(
    stream: &mut S,
    frames: &mut frame::Buffer,
    framed: &[u8],
    check: Check<'_>,
    id: u16,
) -> Result<Vec<u8>, Fault> {
    let io = async {
        stream.write_all(framed).await?;
        // A TLS stream may hold the last record of the query until flushed (TCP: nothing to do).
        stream.flush().await?;
        loop {
            match frames.ready() {
                Ok(true) => return Ok(true),
                // A length prefix below a header's size: never a reply.
                Err(_) => return Ok(false),
                Ok(false) => {}
            }
            let n = stream.read(frames.spare()).await?;
            if n == 0 {
                return Err(io::Error::from(io::ErrorKind::UnexpectedEof));
            }
            frames.filled(n);
        }
    };
    match io.await {
        // EOF, reset, broken pipe: the server closed the connection or went away.
        Err(_) => Err(Fault::Closed),
        Ok(false) => Err(Fault::BadReply),
        Ok(true) => match frames.take() {
            // One query in flight at a time: a reply that does not match can only be garbage;
            // the caller drops (closes) the connection.
            Some(reply) if check.accepts(reply, id) => Ok(reply.to_vec()),
            _ => Err(Fault::BadReply),
        },
    }
}
