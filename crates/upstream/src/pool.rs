//! TCP connections to one upstream address.
//!
//! CoreDNS reads a connection's next query only after answering the previous one, so a
//! connection carries one query at a time and concurrency needs several connections. The pool:
//! - caps connections at `max_connections` with a semaphore whose permits are *slots*: a query
//!   takes a slot first (waiting, within its deadline, when all are busy), then reuses an idle
//!   connection or dials one. Idle connections hold no slot, and a dial only happens when none is
//!   idle, so open connections never exceed the cap.
//! - keeps idle connections on a LIFO stack: a trickle of sequential misses keeps reusing the
//!   newest connection while the others age out; the oldest sit at the bottom, which is where the
//!   reaper looks.
//! - closes idle connections after `expire` with one reaper task that sleeps until the oldest
//!   one's expiry (no polling), because CoreDNS closes a connection after 10 s idle and a query
//!   written into a connection the server is closing is lost.
//! - hands a connection out as a [`Lease`]; only [`Lease::release`] after a complete, validated
//!   exchange returns it to the stack. A lease dropped any other way (error, timeout, the caller's
//!   future dropped mid-query) closes the connection, so a late reply can never be read by the
//!   next query.

use std::io;
use std::mem::MaybeUninit;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::Duration;

use socket2::SockRef;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;
use tokio::sync::{Notify, Semaphore, SemaphorePermit};
use tokio::time::{Instant, sleep_until, timeout_at};

use crate::metrics::{Held, Target};
use crate::msg::Check;

/// Why one exchange with one upstream address failed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Fault {
    /// Waiting for a free connection slot outlasted the deadline: the pool is saturated, the
    /// upstream did nothing wrong.
    Busy,
    /// No connection could be made (refused, unreachable), or a UDP send drew an ICMP error.
    Refused,
    /// The connection was closed or reset with the query in flight.
    Closed,
    /// No reply before the deadline.
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

#[derive(Debug)]
pub(crate) struct Pool {
    addr: SocketAddr,
    expire: Duration,
    /// One permit per connection in use.
    slots: Semaphore,
    /// Idle connections, oldest first; taken from and returned to the end.
    idle: Mutex<Vec<Idle>>,
    /// Wakes the reaper when the stack was empty and a connection went idle.
    went_idle: Notify,
    metrics: Arc<Target>,
}

#[derive(Debug)]
struct Idle {
    conn: Conn,
    since: Instant,
}

/// One open TCP connection. Closing it is dropping it.
#[derive(Debug)]
pub(crate) struct Conn {
    stream: TcpStream,
    /// Keeps `nodedns_upstream_connections` up while the connection is open.
    _open: Held,
}

/// A connection checked out of the pool, with its slot.
#[derive(Debug)]
pub(crate) struct Lease<'a> {
    pool: &'a Pool,
    conn: Conn,
    /// The connection came from the idle stack (so a failure may just mean the server closed it).
    reused: bool,
    _slot: SemaphorePermit<'a>,
}

impl Pool {
    pub(crate) fn new(
        addr: SocketAddr,
        max_connections: usize,
        expire: Duration,
        metrics: Arc<Target>,
    ) -> Self {
        Pool {
            addr,
            expire,
            slots: Semaphore::new(max_connections.min(Semaphore::MAX_PERMITS)),
            idle: Mutex::new(Vec::new()),
            went_idle: Notify::new(),
            metrics,
        }
    }

    fn idle(&self) -> MutexGuard<'_, Vec<Idle>> {
        // Nothing panics while holding the lock; if something ever did, the stack is still valid.
        self.idle.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Takes a slot (waiting for one until `deadline`), then the newest live idle connection, or
    /// a new one.
    pub(crate) async fn acquire(&self, deadline: Instant) -> Result<Lease<'_>, Fault> {
        let slot = match timeout_at(deadline, self.slots.acquire()).await {
            Ok(Ok(slot)) => slot,
            // The semaphore is never closed; a timeout means every connection stayed busy.
            Ok(Err(_)) | Err(_) => return Err(Fault::Busy),
        };
        if let Some(conn) = self.take_idle() {
            self.metrics.tcp_hits.inc();
            return Ok(Lease {
                pool: self,
                conn,
                reused: true,
                _slot: slot,
            });
        }
        let conn = self.dial(deadline).await?;
        Ok(Lease {
            pool: self,
            conn,
            reused: false,
            _slot: slot,
        })
    }

    /// Pops idle connections until one is neither expired nor closed by the peer.
    fn take_idle(&self) -> Option<Conn> {
        let now = Instant::now();
        loop {
            let idle = self.idle().pop()?;
            if now < idle.since + self.expire && idle.conn.alive() {
                return Some(idle.conn);
            }
            // Dropped here, outside the lock: closed.
        }
    }

    async fn dial(&self, deadline: Instant) -> Result<Conn, Fault> {
        self.metrics.tcp_misses.inc();
        let stream = match timeout_at(deadline, TcpStream::connect(self.addr)).await {
            Err(_) => return Err(Fault::Timeout),
            Ok(Err(e)) => {
                tracing::debug!(upstream = %self.addr, error = %e, "connect failed");
                return Err(Fault::Refused);
            }
            Ok(Ok(stream)) => stream,
        };
        // Each query is one small write; without NODELAY, Nagle could hold it behind the ACK of
        // the previous exchange.
        if let Err(e) = stream.set_nodelay(true) {
            tracing::debug!(upstream = %self.addr, error = %e, "TCP_NODELAY not set");
        }
        self.metrics.connects.inc();
        Ok(Conn {
            stream,
            _open: Held::new(&self.metrics.connections),
        })
    }

    fn put(&self, conn: Conn) {
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
                let closed: Vec<Idle> = idle.drain(..expired).collect();
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

    /// Idle connections right now (tests).
    #[cfg(test)]
    pub(crate) fn idle_count(&self) -> usize {
        self.idle().len()
    }
}

impl Conn {
    /// Whether the peer has not closed the connection: a non-blocking peek (one syscall, nothing
    /// consumed) must find no data and no EOF. Data on an idle connection is a stray reply, which
    /// makes the connection as unusable as EOF does.
    fn alive(&self) -> bool {
        let mut byte = [MaybeUninit::<u8>::uninit(); 1];
        // Tokio keeps its sockets non-blocking, so this returns at once.
        matches!(
            SockRef::from(&self.stream).peek(&mut byte),
            Err(e) if e.kind() == io::ErrorKind::WouldBlock
        )
    }
}

impl Lease<'_> {
    /// Sends `query` (a random ID per exchange) and returns the accepted reply. A reused
    /// connection that turns out closed is replaced at once by a fresh one, without counting
    /// against the upstream: the server may have closed it just before the write.
    pub(crate) async fn exchange(
        &mut self,
        query: &[u8],
        deadline: Instant,
    ) -> Result<Vec<u8>, Fault> {
        loop {
            let id = rand::random();
            let framed = crate::msg::framed(query, id);
            match exchange(
                &mut self.conn.stream,
                &framed,
                Check::Answer(query),
                id,
                deadline,
            )
            .await
            {
                Err(Fault::Closed) if self.reused => {
                    self.pool.metrics.resets.inc();
                    self.pool.metrics.retries.inc();
                    tracing::debug!(upstream = %self.pool.addr, "reused connection closed, retrying on a new one");
                    self.conn = self.pool.dial(deadline).await?;
                    self.reused = false;
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

/// One exchange on a connection of its own (health checks: they must not depend on, or disturb,
/// the pool of an address that is misbehaving).
pub(crate) async fn exchange_once(
    addr: SocketAddr,
    msg: &[u8],
    check: Check<'_>,
    deadline: Instant,
) -> Result<Vec<u8>, Fault> {
    let mut stream = match timeout_at(deadline, TcpStream::connect(addr)).await {
        Err(_) => return Err(Fault::Timeout),
        Ok(Err(_)) => return Err(Fault::Refused),
        Ok(Ok(stream)) => stream,
    };
    let _ = stream.set_nodelay(true);
    let id = rand::random();
    exchange(
        &mut stream,
        &crate::msg::framed(msg, id),
        check,
        id,
        deadline,
    )
    .await
}

/// Writes `framed` (length prefix included) and reads one reply, accepted by `check` for `id`,
/// before `deadline`.
async fn exchange(
    stream: &mut TcpStream,
    framed: &[u8],
    check: Check<'_>,
    id: u16,
    deadline: Instant,
) -> Result<Vec<u8>, Fault> {
    let io = async {
        stream.write_all(framed).await?;
        let mut len = [0u8; 2];
        stream.read_exact(&mut len).await?;
        let mut reply = vec![0u8; usize::from(u16::from_be_bytes(len))];
        stream.read_exact(&mut reply).await?;
        Ok::<_, io::Error>(reply)
    };
    match timeout_at(deadline, io).await {
        Err(_) => Err(Fault::Timeout),
        // EOF, reset, broken pipe: the server closed the connection or went away.
        Ok(Err(_)) => Err(Fault::Closed),
        // One query in flight at a time: a reply that does not match can only be garbage; the
        // caller drops (closes) the connection.
        Ok(Ok(reply)) if check.accepts(&reply, id) => Ok(reply),
        Ok(Ok(_)) => Err(Fault::BadReply),
    }
}
