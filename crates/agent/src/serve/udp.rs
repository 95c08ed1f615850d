//! UDP listeners: one blocking OS thread per listen address and worker.
//!
//! Each worker owns its own socket in the address's `SO_REUSEPORT` group, so the kernel spreads
//! clients over workers with no shared queue and no lock. The loop:
//!
//! 1. `recvmmsg` a batch (blocks until at least one datagram is there, then takes what is queued);
//! 2. for each datagram run [`pipeline::answer`]: a hit or a refusal is written into that slot's
//!    reusable output buffer; a miss is handed to the async runtime with a [`Waiter`] (and the
//!    rare hit that starts a background refresh hands that over too, with no waiter);
//! 3. `sendmmsg` the batch of answers.
//!
//! Invariants: no allocation per query after warm-up (buffers are reused), no lock, no await;
//! the async runtime is woken only for misses. The socket has a receive timeout so the loop sees
//! shutdown within [`POLL`] even when no query arrives.

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
use socket2::{Domain, Protocol, Socket, Type};

use super::Shared;
use super::pipeline::{self, Front, Recorder, ReplyTo};
use super::ratelimit::{Clock, Limiter, Verdict};
use super::request::{Client, MAX_QUERY, Proto};
use crate::metrics::Counters;

/// Datagrams taken per `recvmmsg` at most.
const BATCH: usize = 64;
/// Datagrams asked for when the last batch was small.
const MIN_WANT: usize = 4;
/// How often an idle worker checks for shutdown.
const POLL: Duration = Duration::from_millis(100);
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

/// Sends one datagram without blocking (for answers sent from async tasks: the worker thread
/// owns the blocking reads of the same socket).
pub fn send_nonblocking(socket: &UdpSocket, buf: &[u8], peer: SocketAddr) -> nix::Result<usize> {
    let addr = SockaddrStorage::from(peer);
    sendto(socket.as_raw_fd(), buf, &addr, MsgFlags::MSG_DONTWAIT)
}

/// Runs one worker until shutdown, or until `stop` is set (the socket was handed to another
/// instance). `local` is the address the socket is bound to. A batch that was read is always
/// answered before the loop looks at either flag.
pub fn run(
    shared: Arc<Shared>,
    socket: Arc<UdpSocket>,
    local: SocketAddr,
    runtime: tokio::runtime::Handle,
    stop: Arc<AtomicBool>,
) {
    let counters = shared.metrics.worker(local);
    let clients = shared.clients.worker();
    let log = shared.querylog.single_writer();
    let to = Recorder {
        counters: &counters,
        clients: clients.as_deref(),
        log: &log,
    };
    let mut worker = Worker::new(&shared.udp_limit);
    while !shared.stopping() && !stop.load(Ordering::Relaxed) {
        match worker.serve_batch(&shared, &to, &socket, local, &runtime) {
            Ok(()) => {}
            Err(Errno::EAGAIN | Errno::EINTR) => {}
            Err(err) => {
                counters.recv_failed();
                tracing::warn!(%local, %err, "UDP receive failed");
            }
        }
    }
}

/// One worker's reusable buffers. Nothing is allocated per batch: the send side's I/O vectors
/// borrow the buffers, so they are kept as an empty vector between batches and refilled in place
/// ([`recycle`]).
struct Worker {
    inbuf: Vec<[u8; MAX_QUERY]>,
    outbuf: Vec<Vec<u8>>,
    recv_headers: MultiHeaders<SockaddrStorage>,
    send_headers: MultiHeaders<SockaddrStorage>,
    /// (length, peer) of each datagram of the current batch.
    received: Vec<(usize, Option<SockaddrStorage>)>,
    /// Slot of each answer of the current batch.
    answers: Vec<usize>,
    /// Peers of the answers, in order (what `sendmmsg` takes).
    peers: Vec<Option<SockaddrStorage>>,
    send_iovs: Vec<[IoSlice<'static>; 1]>,
    /// Datagrams asked of the next `recvmmsg`: twice the last batch, so a lightly loaded worker
    /// does not set up a full batch of headers for every datagram, and a busy one grows to
    /// [`BATCH`].
    want: usize,
    /// The time the rate limit reads, per batch.
    clock: Clock,
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
            answers: Vec::with_capacity(BATCH),
            peers: Vec::with_capacity(BATCH),
            send_iovs: Vec::with_capacity(BATCH),
            want: MIN_WANT,
            clock: limiter.clock(),
        }
    }

    fn serve_batch(
        &mut self,
        shared: &Arc<Shared>,
        to: &Recorder<'_>,
        socket: &Arc<UdpSocket>,
        local: SocketAddr,
        runtime: &tokio::runtime::Handle,
    ) -> Result<(), Errno> {
        let fd = socket.as_raw_fd();
        if self.want <= MIN_WANT {
            self.receive::<MIN_WANT>(fd)?;
        } else {
            self.receive::<BATCH>(fd)?;
        }
        self.want = (self.received.len() * 2).clamp(MIN_WANT, BATCH);
        let now = Instant::now();
        let clock = self.clock.read(&shared.udp_limit, now);
        let snap = shared.snapshot.load();
        self.answers.clear();
        for (slot, &(len, peer)) in self.received.iter().enumerate() {
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
                Front::Miss(mut miss) => {
                    let waiter = miss.waiter(packet, ReplyTo::Udp(socket.clone()), client, now);
                    pipeline::spawn(shared, runtime, miss, waiter);
                }
            }
        }
        self.send_answers(fd, to.counters);
        Ok(())
    }

    /// Takes up to `N` datagrams into `received`, blocking until there is one.
    ///
    /// nix ties the I/O vectors' borrow to the results', so they cannot be recycled like the send
    /// side's; they are a stack array of `N`, set up per call, so a lightly loaded worker
    /// (`N` = [`MIN_WANT`]) does not pay for a full batch.
    fn receive<const N: usize>(&mut self, fd: i32) -> Result<(), Errno> {
        self.received.clear();
        let mut bufs = self.inbuf.iter_mut();
        let mut iovs: [[IoSliceMut<'_>; 1]; N] = std::array::from_fn(|_| {
            [IoSliceMut::new(
                bufs.next().map_or(&mut [][..], |b| &mut b[..]),
            )]
        });
        let results = recvmmsg(
            fd,
            &mut self.recv_headers,
            iovs.iter_mut(),
            MsgFlags::MSG_WAITFORONE,
            None,
        )?;
        for msg in results {
            // A datagram longer than the buffer was cut by the kernel: parse nothing.
            let len = if msg.flags.contains(MsgFlags::MSG_TRUNC) {
                0
            } else {
                msg.bytes
            };
            self.received.push((len, msg.address));
        }
        Ok(())
    }

    fn send_answers(&mut self, fd: i32, counters: &Counters) {
        if let [slot] = self.answers[..] {
            // One answer (the common case below saturation): a plain sendto.
            if let Some(peer) = &self.received[slot].1 {
                if sendto(fd, &self.outbuf[slot], peer, MsgFlags::empty()).is_err() {
                    counters.send_failed();
                }
            }
            return;
        }
        self.peers.clear();
        self.peers
            .extend(self.answers.iter().map(|&slot| self.received[slot].1));
        let mut iovs = recycle(std::mem::take(&mut self.send_iovs));
        iovs.extend(
            self.answers
                .iter()
                .map(|&slot| [IoSlice::new(&self.outbuf[slot])]),
        );
        let mut done = 0;
        while done < iovs.len() {
            match sendmmsg(
                fd,
                &mut self.send_headers,
                &iovs[done..],
                &self.peers[done..],
                [],
                MsgFlags::empty(),
            ) {
                Ok(results) => {
                    // A short count means the next datagram failed; the next call reports its
                    // error.
                    let sent = results.count();
                    if sent == 0 {
                        counters.send_failed();
                        done += 1;
                    }
                    done += sent;
                }
                Err(Errno::EINTR) => {}
                Err(_) => {
                    // The first datagram of the rest failed (e.g. an unreachable peer): skip it.
                    counters.send_failed();
                    done += 1;
                }
            }
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
