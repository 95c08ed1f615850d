//! One hand-over connection between two instances: a `SOCK_SEQPACKET` Unix socket, so every
//! message keeps its boundaries and a descriptor travels with the message it belongs to.
//!
//! Messages are one short line of text each (`socket udp 127.0.0.1:53`), at most one descriptor
//! attached (`SCM_RIGHTS`). Received descriptors arrive as `OwnedFd` (rustix), so nothing here
//! needs `unsafe`; they are opened close-on-exec.

use std::io::{self, IoSlice, IoSliceMut};
use std::mem::MaybeUninit;
use std::net::SocketAddr;
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::path::Path;

use rustix::net::{
    AddressFamily, RecvAncillaryBuffer, RecvAncillaryMessage, RecvFlags, ReturnFlags,
    SendAncillaryBuffer, SendAncillaryMessage, SendFlags, SocketAddrUnix, SocketFlags, SocketType,
};
use tokio::io::Interest;
use tokio::io::unix::AsyncFd;

use super::Kind;

/// Version of the protocol below. 2 adds `cache`. An instance speaks every version from
/// [`OLDEST`] up: a new instance asks in its own version first, and if the running one closes
/// the connection at that (a version-1 instance refuses any other), asks again in version 1.
pub const VERSION: u32 = 2;
/// The oldest version this instance still speaks.
pub const OLDEST: u32 = 1;

/// Longest message (the longest is a `socket` line with an IPv6 address).
const MAX_MESSAGE: usize = 256;

/// What two instances say to each other.
///
/// ```text
/// new → running   hello <version> <pid>
/// running → new   socket <udp|tcp|admin> <addr>   (one descriptor attached), repeated
/// running → new   end
/// running → new   cache            (version 2; one descriptor attached: a Unix stream socket)
///                                  what follows the sockets: the running instance writes its
///                                  cache into it, then closes it (the app's business, not this
///                                  protocol's)
/// new → running   serving          the new instance reads every socket now; the running one
///                                  stops reading and goes idle
/// idle → its own predecessor   released   "another instance took over from me: never take the
///                                          sockets back because of me"
/// idle → serving  bye              the idle instance exits; the serving one is the last
/// serving → idle  take, socket…, end[, cache]   the serving instance exits: serve these again
///                                                (`cache` if the idle one speaks version 2)
/// idle → serving  taken            it does
/// ```
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Message {
    Hello { version: u32, pid: u32 },
    Socket { kind: Kind, addr: SocketAddr },
    End,
    Cache,
    Serving,
    Released,
    Bye,
    Take,
    Taken,
}

impl Message {
    fn encode(&self) -> String {
        match self {
            Message::Hello { version, pid } => format!("hello {version} {pid}"),
            Message::Socket { kind, addr } => format!("socket {} {addr}", kind.name()),
            Message::End => "end".to_owned(),
            Message::Cache => "cache".to_owned(),
            Message::Serving => "serving".to_owned(),
            Message::Released => "released".to_owned(),
            Message::Bye => "bye".to_owned(),
            Message::Take => "take".to_owned(),
            Message::Taken => "taken".to_owned(),
        }
    }

    fn decode(text: &str) -> Option<Message> {
        let mut words = text.split(' ');
        let message = match words.next()? {
            "hello" => Message::Hello {
                version: words.next()?.parse().ok()?,
                pid: words.next()?.parse().ok()?,
            },
            "socket" => Message::Socket {
                kind: Kind::from_name(words.next()?)?,
                addr: words.next()?.parse().ok()?,
            },
            "end" => Message::End,
            "cache" => Message::Cache,
            "serving" => Message::Serving,
            "released" => Message::Released,
            "bye" => Message::Bye,
            "take" => Message::Take,
            "taken" => Message::Taken,
            _ => return None,
        };
        words.next().is_none().then_some(message)
    }
}

/// One end of a hand-over connection.
#[derive(Debug)]
pub struct Link {
    fd: AsyncFd<OwnedFd>,
}

/// A new `SOCK_SEQPACKET` Unix socket, non-blocking and close-on-exec.
pub(super) fn seqpacket() -> io::Result<OwnedFd> {
    Ok(rustix::net::socket_with(
        AddressFamily::UNIX,
        SocketType::SEQPACKET,
        SocketFlags::CLOEXEC | SocketFlags::NONBLOCK,
        None,
    )?)
}

/// A connected pair of Unix stream sockets, close-on-exec, blocking (each end is handed to
/// tokio by whoever uses it): what `cache` attaches one end of.
pub(super) fn stream_pair() -> io::Result<(OwnedFd, OwnedFd)> {
    Ok(rustix::net::socketpair(
        AddressFamily::UNIX,
        SocketType::STREAM,
        SocketFlags::CLOEXEC,
        None,
    )?)
}

/// Registers `fd` with the tokio reactor.
///
/// `AsyncFd::new` is deprecated because, for an arbitrary `T: AsRawFd`, nothing guarantees that
/// the descriptor stays open and the same while registered (the replacement, `register`, is
/// `unsafe` for that reason, and this workspace denies `unsafe`). An `OwnedFd` guarantees
/// exactly that: it owns the descriptor, closes it only on drop, and `as_raw_fd` never changes.
#[allow(deprecated)]
pub(super) fn register(fd: OwnedFd) -> io::Result<AsyncFd<OwnedFd>> {
    AsyncFd::new(fd)
}

impl Link {
    /// Wraps a connected, non-blocking `SOCK_SEQPACKET` socket. Needs a tokio runtime.
    pub fn new(fd: OwnedFd) -> io::Result<Link> {
        Ok(Link { fd: register(fd)? })
    }

    /// Connects to the instance listening at `path`. The connect of a Unix socket completes at
    /// once (or fails: `ECONNREFUSED` when nobody listens on an existing path, `ENOENT` when
    /// there is no path), so it is done synchronously.
    pub fn connect(path: &Path) -> io::Result<Link> {
        let fd = seqpacket()?;
        let addr = SocketAddrUnix::new(path)?;
        match rustix::net::connect(&fd, &addr) {
            Ok(()) => {}
            // A full backlog makes a non-blocking connect fail with EAGAIN; the listener is
            // another instance's, which accepts promptly: report it as refused.
            Err(rustix::io::Errno::AGAIN) => {
                return Err(io::Error::new(
                    io::ErrorKind::ConnectionRefused,
                    "hand-over socket's backlog is full",
                ));
            }
            Err(err) => return Err(err.into()),
        }
        Link::new(fd)
    }

    /// Sends one message, with `fd` attached if given.
    pub async fn send(&self, message: &Message, fd: Option<BorrowedFd<'_>>) -> io::Result<()> {
        let text = message.encode();
        let fds: [BorrowedFd<'_>; 1];
        let mut space = [MaybeUninit::uninit(); rustix::cmsg_space!(ScmRights(1))];
        let mut control = SendAncillaryBuffer::new(&mut space);
        if let Some(fd) = fd {
            fds = [fd];
            if !control.push(SendAncillaryMessage::ScmRights(&fds)) {
                return Err(io::Error::other("no room for the descriptor"));
            }
        }
        let iov = [IoSlice::new(text.as_bytes())];
        self.fd
            .async_io(Interest::WRITABLE, |fd| {
                // NOSIGNAL: a peer that went away is an error here, not a SIGPIPE.
                rustix::net::sendmsg(fd, &iov, &mut control, SendFlags::NOSIGNAL)
                    .map_err(io::Error::from)
            })
            .await
            .map(|_| ())
    }

    /// Receives one message and the descriptor attached to it, if any. `Ok(None)` when the peer
    /// closed the connection. Cancel-safe: a message is either fully received or not at all.
    pub async fn recv(&self) -> io::Result<Option<(Message, Option<OwnedFd>)>> {
        let mut buf = [0u8; MAX_MESSAGE];
        let mut space = [MaybeUninit::uninit(); rustix::cmsg_space!(ScmRights(1))];
        let (bytes, fd) = self
            .fd
            .async_io(Interest::READABLE, |fd| {
                let mut control = RecvAncillaryBuffer::new(&mut space);
                let mut iov = [IoSliceMut::new(&mut buf)];
                let received =
                    rustix::net::recvmsg(fd, &mut iov, &mut control, RecvFlags::CMSG_CLOEXEC)
                        .map_err(io::Error::from)?;
                // Take ownership of every descriptor that came (so extras are closed), keep
                // the first.
                let mut first = None;
                for message in control.drain() {
                    if let RecvAncillaryMessage::ScmRights(fds) = message {
                        for fd in fds {
                            first.get_or_insert(fd);
                        }
                    }
                }
                if received
                    .flags
                    .intersects(ReturnFlags::TRUNC | ReturnFlags::CTRUNC)
                {
                    return Err(io::Error::new(
                        io::ErrorKind::InvalidData,
                        "hand-over message truncated",
                    ));
                }
                Ok((received.bytes, first))
            })
            .await?;
        // Every message has at least one byte: zero bytes is the end of the connection.
        if bytes == 0 {
            return Ok(None);
        }
        let text = std::str::from_utf8(&buf[..bytes]).ok();
        match text.and_then(Message::decode) {
            Some(message) => Ok(Some((message, fd))),
            None => Err(io::Error::new(
                io::ErrorKind::InvalidData,
                format!(
                    "not a hand-over message: {:?}",
                    String::from_utf8_lossy(&buf[..bytes])
                ),
            )),
        }
    }

    /// Stops both directions, so the peer sees the end at once even while this process keeps
    /// the descriptor.
    pub fn shutdown(&self) {
        let _ = rustix::net::shutdown(self.fd.get_ref(), rustix::net::Shutdown::Both);
    }
}

impl AsFd for Link {
    fn as_fd(&self) -> BorrowedFd<'_> {
        self.fd.get_ref().as_fd()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pair() -> (Link, Link) {
        let (a, b) = rustix::net::socketpair(
            AddressFamily::UNIX,
            SocketType::SEQPACKET,
            SocketFlags::CLOEXEC | SocketFlags::NONBLOCK,
            None,
        )
        .unwrap();
        (Link::new(a).unwrap(), Link::new(b).unwrap())
    }

    #[test]
    fn every_message_survives_encoding() {
        let messages = [
            Message::Hello {
                version: VERSION,
                pid: 4242,
            },
            Message::Socket {
                kind: Kind::Udp,
                addr: "169.254.20.10:53".parse().unwrap(),
            },
            Message::Socket {
                kind: Kind::Admin,
                addr: "[fd00::10]:8080".parse().unwrap(),
            },
            Message::End,
            Message::Cache,
            Message::Serving,
            Message::Released,
            Message::Bye,
            Message::Take,
            Message::Taken,
        ];
        for message in messages {
            let text = message.encode();
            assert!(text.len() <= MAX_MESSAGE);
            assert_eq!(Message::decode(&text), Some(message), "{text}");
        }
    }

    #[test]
    fn unknown_or_malformed_messages_are_rejected() {
        for bad in [
            "",
            "hello",
            "hello 1",
            "hello x 1",
            "hello 1 2 3",
            "socket udp",
            "socket raw 127.0.0.1:53",
            "socket tcp 127.0.0.1",
            "end now",
            "HELLO 1 2",
            "taken ",
        ] {
            assert_eq!(Message::decode(bad), None, "{bad:?}");
        }
    }

    #[tokio::test]
    async fn a_descriptor_travels_with_its_message() {
        let (a, b) = pair();
        let socket = std::net::UdpSocket::bind("127.0.0.1:0").unwrap();
        let addr = socket.local_addr().unwrap();
        let message = Message::Socket {
            kind: Kind::Udp,
            addr,
        };
        a.send(&message, Some(socket.as_fd())).await.unwrap();
        a.send(&Message::End, None).await.unwrap();
        let (got, fd) = b.recv().await.unwrap().unwrap();
        assert_eq!(got, message);
        let received = std::net::UdpSocket::from(fd.expect("a descriptor"));
        // The very same socket: what is sent to it can be read from the received descriptor.
        assert_eq!(received.local_addr().unwrap(), addr);
        let sender = std::net::UdpSocket::bind("127.0.0.1:0").unwrap();
        sender.send_to(b"ping", addr).unwrap();
        let mut buf = [0; 8];
        received
            .set_read_timeout(Some(std::time::Duration::from_secs(5)))
            .unwrap();
        let (n, _) = received.recv_from(&mut buf).unwrap();
        assert_eq!(&buf[..n], b"ping");
        let (end, none) = b.recv().await.unwrap().unwrap();
        assert_eq!((end, none.is_none()), (Message::End, true));
    }

    #[tokio::test]
    async fn a_closed_peer_reads_as_the_end() {
        let (a, b) = pair();
        drop(a);
        assert!(b.recv().await.unwrap().is_none());
        let (c, d) = pair();
        c.shutdown();
        assert!(d.recv().await.unwrap().is_none());
        assert!(c.send(&Message::Bye, None).await.is_err());
    }

    #[tokio::test]
    async fn garbage_from_the_peer_is_an_error_not_a_panic() {
        let (a, b) = pair();
        rustix::net::send(&a, b"\xff\xfe garbage", SendFlags::empty()).unwrap();
        let err = b.recv().await.unwrap_err();
        assert_eq!(err.kind(), io::ErrorKind::InvalidData);
    }
}
