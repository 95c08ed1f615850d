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
