//! How a pool opens its connections: the seam between the pool's logic (slots, the idle stack,
//! expiry, retries) and the transport under it.
//!
//! A connection is any byte stream (`AsyncRead + AsyncWrite + Unpin + Send`): plain TCP in
//! production ([`Tcp`]), TLS over TCP for `forward tls://`, an in-memory pipe in the tests, which
//! lets them run on tokio's paused clock. Dispatch is static (the pool is generic over its
//! [`Dial`]), so the seam costs nothing per query; the dialer's future is the only thing that
//! differs, once per connection.

use std::future::Future;
use std::io;
use std::mem::MaybeUninit;
use std::net::SocketAddr;
use std::pin::Pin;
use std::task::{Context, Poll, Waker};

use socket2::SockRef;
use tokio::io::{AsyncRead, AsyncWrite, Interest, ReadBuf};
use tokio::net::TcpStream;

/// Opens connections to upstream addresses.
pub trait Dial: Send + Sync + 'static {
    /// An open connection. Closing it is dropping it.
    type Conn: AsyncRead + AsyncWrite + Unpin + Send + 'static;

    /// Opens a connection to `addr`, ready for DNS messages (handshakes done). No timer of its
    /// own: the caller bounds it (the exchange's read timeout, the query's deadline) by dropping
    /// the future. An error is a refused or unreachable upstream.
    fn dial(&self, addr: SocketAddr) -> impl Future<Output = io::Result<Self::Conn>> + Send;

    /// Whether an idle connection can carry the next query: the peer has not closed it and has
    /// sent nothing unasked (on a connection with no query outstanding, data is a stray reply,
    /// which makes it as unusable as EOF does). Must not block or wait.
    fn usable(&self, conn: &mut Self::Conn) -> bool {
        nothing_to_read(conn)
    }

    /// Whether [`Dial::rehome`] can move `conn` to another runtime.
    fn movable(&self, conn: &Self::Conn) -> bool {
        let _ = conn;
        false
    }

    /// The idle connection `conn`, opened on another runtime, moved to the current one (its
    /// socket taken off the other runtime's reactor and registered with this one's), or `None`
    /// when it could not be moved (it is closed). Without a reactor behind it (an in-memory
    /// pipe), it is the same connection.
    fn rehome(&self, conn: Self::Conn) -> Option<Self::Conn> {
        drop(conn);
        None
    }
}

/// Whether a read on `conn` would wait: no data, no EOF, no error. For any stream: one poll with
/// a waker that does nothing (no task is waiting to be woken; the next exchange polls again with
/// its own). A TLS stream processes whatever records arrived meanwhile (session tickets, a
/// close_notify) and reports only what the application would read.
pub(crate) fn nothing_to_read<S: AsyncRead + Unpin>(conn: &mut S) -> bool {
    let mut byte = [0u8; 1];
    let mut buf = ReadBuf::new(&mut byte);
    let mut cx = Context::from_waker(Waker::noop());
    matches!(Pin::new(conn).poll_read(&mut cx, &mut buf), Poll::Pending)
}

/// Plain TCP with `TCP_NODELAY` (production).
#[derive(Debug, Clone, Copy, Default)]
pub struct Tcp;

impl Dial for Tcp {
    type Conn = TcpStream;

    async fn dial(&self, addr: SocketAddr) -> io::Result<TcpStream> {
        let stream = TcpStream::connect(addr).await?;
        // Each query is one small write; without NODELAY, Nagle could hold it behind the ACK of
        // the previous exchange.
        if let Err(e) = stream.set_nodelay(true) {
            tracing::debug!(upstream = %addr, error = %e, "TCP_NODELAY not set");
        }
        Ok(stream)
    }

    /// No data and no EOF. When the runtime has not seen the socket become readable since the
    /// last reply was read (the read that took it was short, which clears the readiness), that
    /// is the answer, without a syscall; otherwise a non-blocking peek (nothing consumed) asks
    /// the kernel. A FIN that arrives after the runtime last polled is not seen here; the
    /// exchange then finds the connection closed and retries on a new one at once
    /// ([`crate::pool`]), at the cost of one write.
    fn usable(&self, conn: &mut TcpStream) -> bool {
        let mut byte = [MaybeUninit::<u8>::uninit(); 1];
        let peek = conn.try_io(Interest::READABLE, || SockRef::from(&*conn).peek(&mut byte));
        matches!(peek, Err(e) if e.kind() == io::ErrorKind::WouldBlock)
    }

    fn movable(&self, _: &TcpStream) -> bool {
        true
    }

    /// Two `epoll_ctl` calls, where a new connection would cost a handshake with the upstream.
    fn rehome(&self, conn: TcpStream) -> Option<TcpStream> {
        let moved = conn.into_std().and_then(TcpStream::from_std);
        moved
            .inspect_err(|e| tracing::debug!(error = %e, "an idle connection could not move"))
            .ok()
    }
}

#[cfg(test)]
mod tests {
    use std::net::Ipv4Addr;

    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    use tokio::net::TcpListener;

    use super::*;

    async fn listener() -> (TcpListener, SocketAddr) {
        let listener = TcpListener::bind((Ipv4Addr::LOCALHOST, 0)).await.unwrap();
        let addr = listener.local_addr().unwrap();
        (listener, addr)
    }

    #[tokio::test]
    async fn tcp_dials_with_nodelay_and_sees_the_peer_close() {
        let (listener, addr) = listener().await;
        let mut conn = Tcp.dial(addr).await.expect("connected");
        assert!(conn.nodelay().unwrap());
        let (server, _) = listener.accept().await.unwrap();
        assert!(Tcp.usable(&mut conn), "idle and open");
        drop(server);
        conn.readable().await.unwrap();
        assert!(!Tcp.usable(&mut conn), "the peer closed it");
    }

    #[tokio::test]
    async fn tcp_data_nobody_asked_for_makes_a_connection_unusable() {
        let (listener, addr) = listener().await;
        let mut conn = Tcp.dial(addr).await.unwrap();
        let (mut server, _) = listener.accept().await.unwrap();
        server.write_all(&[0, 12]).await.unwrap();
        conn.readable().await.unwrap();
        assert!(!Tcp.usable(&mut conn));
    }

    #[tokio::test]
    async fn tcp_is_usable_again_once_a_reply_was_read_and_unusable_when_more_comes() {
        let (listener, addr) = listener().await;
        let mut conn = Tcp.dial(addr).await.unwrap();
        let (mut server, _) = listener.accept().await.unwrap();
        server.write_all(&[0, 2, 7, 7]).await.unwrap();
        let mut reply = [0u8; 512];
        let n = conn.read(&mut reply).await.unwrap();
        assert_eq!(n, 4, "the whole reply in one short read");
        assert!(Tcp.usable(&mut conn), "nothing left after the reply");
        server.write_all(&[0, 2]).await.unwrap();
        conn.readable().await.unwrap();
        assert!(!Tcp.usable(&mut conn), "bytes nobody asked for");
    }

    /// A runtime of its own, as each of the agent's UDP workers has.
    fn runtime() -> tokio::runtime::Runtime {
        tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap()
    }

    /// A server that echoes what it reads, on a thread of its own, and its address.
    fn echo_server() -> SocketAddr {
        let listener = std::net::TcpListener::bind((Ipv4Addr::LOCALHOST, 0)).unwrap();
        let addr = listener.local_addr().unwrap();
        std::thread::spawn(move || {
            use std::io::{Read, Write};
            let (mut conn, _) = listener.accept().unwrap();
            let mut buf = [0u8; 512];
            while let Ok(n @ 1..) = conn.read(&mut buf) {
                conn.write_all(&buf[..n]).unwrap();
            }
        });
        addr
    }

    #[test]
    fn tcp_moves_to_another_runtime_and_its_replies_are_seen_there() {
        let (home, other) = (runtime(), runtime());
        let addr = echo_server();
        let conn = home.block_on(Tcp.dial(addr)).unwrap();
        assert!(Tcp.movable(&conn));
        // The other runtime's reactor watches it now: the reply is seen while the runtime that
        // opened it does not run at all.
        let echoed = other.block_on(async {
            let mut conn = Tcp.rehome(conn).expect("moved");
            assert!(conn.nodelay().unwrap(), "the socket's options stay");
            conn.write_all(&[0, 2, 1, 2]).await.unwrap();
            let mut reply = [0u8; 4];
            conn.read_exact(&mut reply).await.unwrap();
            reply
        });
        assert_eq!(echoed, [0, 2, 1, 2]);
    }

    #[test]
    fn tcp_from_a_runtime_that_ended_moves_or_is_closed_without_a_panic() {
        let (home, other) = (runtime(), runtime());
        let addr = echo_server();
        let conn = home.block_on(Tcp.dial(addr)).unwrap();
        drop(home);
        other.block_on(async {
            if let Some(mut conn) = Tcp.rehome(conn) {
                conn.write_all(&[0, 2, 1, 2]).await.unwrap();
                let mut reply = [0u8; 4];
                conn.read_exact(&mut reply).await.unwrap();
            }
        });
    }

    #[tokio::test]
    async fn tcp_to_an_address_nothing_listens_on_is_an_error() {
        let (listener, addr) = listener().await;
        drop(listener);
        assert!(Tcp.dial(addr).await.is_err());
    }

    #[tokio::test]
    async fn any_stream_is_usable_until_its_peer_writes_or_closes() {
        let (mut conn, mut peer) = tokio::io::duplex(64);
        assert!(nothing_to_read(&mut conn));
        peer.write_all(&[1]).await.unwrap();
        assert!(!nothing_to_read(&mut conn), "stray data");

        let (mut conn, peer) = tokio::io::duplex(64);
        drop(peer);
        assert!(!nothing_to_read(&mut conn), "EOF");
    }
}
