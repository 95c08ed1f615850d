//! Who is at the other end of an admin connection: the user owning the client's socket, from the
//! kernel's socket table (`NETLINK_SOCK_DIAG`, what `ss -e` reads), looked up by the
//! connection's addresses and ports.
//!
//! Why not the address alone: loopback is shared by every process of the network namespace, and
//! in the hostNetwork modes that is every hostNetwork pod of the node. The owner of the client's
//! socket is set by the kernel when the client created it and cannot be chosen by the client.
//! The answer is only meaningful for a client in this network namespace (loopback): a remote
//! client's socket is in no table here.

use std::io;
use std::net::{IpAddr, SocketAddr};

use rustix::net::{AddressFamily, RecvFlags, SendFlags, SocketFlags, SocketType};

/// `SOCK_DIAG_BY_FAMILY` (linux/sock_diag.h): the request and its answer.
const SOCK_DIAG_BY_FAMILY: u16 = 20;
/// `NLMSG_ERROR` (linux/netlink.h).
const NLMSG_ERROR: u16 = 2;
const NLM_F_REQUEST: u16 = 1;
/// `struct nlmsghdr`.
const HEADER: usize = 16;
/// `struct inet_diag_req_v2`: family, protocol, ext, pad, states, then the socket id.
const REQUEST: usize = 8 + SOCKET_ID;
/// `struct inet_diag_sockid`: ports, source and destination (16 bytes each), interface, cookie.
const SOCKET_ID: usize = 4 + 16 + 16 + 4 + 8;
/// Offsets in `struct inet_diag_msg`: the state after the family; the uid after the socket id
/// and three `u32`s (expires, rqueue, wqueue).
const MSG_STATE: usize = 1;
const MSG_UID: usize = 4 + SOCKET_ID + 12;
const IPPROTO_TCP: u8 = 6;
/// `TCP_TIME_WAIT` and `TCP_NEW_SYN_RECV`: minisockets the kernel reports with uid 0, whoever
/// owned the connection.
const TIME_WAIT: u8 = 6;
const NEW_SYN_RECV: u8 = 12;
const ENOENT: i32 = 2;

/// The uid (as this process's user namespace sees it) owning the TCP socket at `client` that is
/// connected to `server`. `None` when the kernel knows no such socket in this network
/// namespace (a remote client, or one that already closed).
pub fn owner(client: SocketAddr, server: SocketAddr) -> io::Result<Option<u32>> {
    let client = SocketAddr::new(client.ip().to_canonical(), client.port());
    let server = SocketAddr::new(server.ip().to_canonical(), server.port());
    let family = match (client.ip(), server.ip()) {
        (IpAddr::V4(_), IpAddr::V4(_)) => AddressFamily::INET,
        (IpAddr::V6(_), IpAddr::V6(_)) => AddressFamily::INET6,
        _ => return Ok(None),
    };
    let fd = rustix::net::socket_with(
        AddressFamily::NETLINK,
        SocketType::DGRAM,
        SocketFlags::CLOEXEC,
        Some(rustix::net::netlink::SOCK_DIAG),
    )?;
    rustix::net::send(&fd, &request(family, client, server), SendFlags::empty())?;
    // The kernel answers an exact lookup while handling the request: the answer is queued when
    // `send` returns.
    let mut buf = [0u8; 512];
    let (len, _) = rustix::net::recv(&fd, &mut buf[..], RecvFlags::DONTWAIT)?;
    parse(&buf[..len.min(buf.len())])
}

/// The netlink message asking for the one TCP socket whose local end is `client` and remote end
/// `server` (the kernel looks it up like an arriving packet from `server` to `client`).
fn request(family: AddressFamily, client: SocketAddr, server: SocketAddr) -> Vec<u8> {
    let mut out = Vec::with_capacity(HEADER + REQUEST);
    let len = u32::try_from(HEADER + REQUEST).expect("small");
    out.extend(len.to_ne_bytes());
    out.extend(SOCK_DIAG_BY_FAMILY.to_ne_bytes());
    out.extend(NLM_F_REQUEST.to_ne_bytes());
    out.extend(1u32.to_ne_bytes()); // sequence number
    out.extend(0u32.to_ne_bytes()); // port id: the kernel fills it in
    out.push(u8::try_from(family.as_raw()).expect("INET and INET6 fit a byte"));
    out.push(IPPROTO_TCP);
    out.extend([0, 0]); // extensions, padding
    out.extend(u32::MAX.to_ne_bytes()); // every state
    out.extend(client.port().to_be_bytes());
    out.extend(server.port().to_be_bytes());
    out.extend(address(client.ip()));
    out.extend(address(server.ip()));
    out.extend(0u32.to_ne_bytes()); // any interface
    // INET_DIAG_NOCOOKIE, twice: look the socket up by its addresses alone.
    out.extend(u32::MAX.to_ne_bytes());
    out.extend(u32::MAX.to_ne_bytes());
    out
}

fn address(ip: IpAddr) -> [u8; 16] {
    let mut out = [0; 16];
    match ip {
        IpAddr::V4(v4) => out[..4].copy_from_slice(&v4.octets()),
        IpAddr::V6(v6) => out = v6.octets(),
    }
    out
}

fn parse(answer: &[u8]) -> io::Result<Option<u32>> {
    let short = || io::Error::new(io::ErrorKind::InvalidData, "short sock_diag answer");
    let header = answer.get(..HEADER).ok_or_else(short)?;
    let kind = u16::from_ne_bytes([header[4], header[5]]);
    let body = &answer[HEADER..];
    match kind {
        NLMSG_ERROR => {
            let code = body.get(..4).ok_or_else(short)?;
            let errno = -i32::from_ne_bytes(code.try_into().expect("4 bytes"));
            match errno {
                ENOENT => Ok(None),
                errno => Err(io::Error::from_raw_os_error(errno)),
            }
        }
        SOCK_DIAG_BY_FAMILY => {
            let state = *body.get(MSG_STATE).ok_or_else(short)?;
            let uid = body.get(MSG_UID..MSG_UID + 4).ok_or_else(short)?;
            if state == TIME_WAIT || state == NEW_SYN_RECV {
                return Ok(None);
            }
            Ok(Some(u32::from_ne_bytes(uid.try_into().expect("4 bytes"))))
        }
        other => Err(io::Error::new(
            io::ErrorKind::InvalidData,
            format!("unexpected sock_diag message type {other}"),
        )),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_owner_of_a_loopback_client_socket_is_this_process_user() {
        let me = nix::unistd::geteuid().as_raw();
        for listen in ["127.0.0.1:0", "[::1]:0"] {
            let Ok(listener) = std::net::TcpListener::bind(listen) else {
                continue; // no IPv6 on this machine
            };
            let server = listener.local_addr().unwrap();
            let client = std::net::TcpStream::connect(server).unwrap();
            let (accepted, peer) = listener.accept().unwrap();
            assert_eq!(peer, client.local_addr().unwrap());
            assert_eq!(owner(peer, server).unwrap(), Some(me), "{listen}");
            // The server's own end is found too, the other way round.
            assert_eq!(owner(server, peer).unwrap(), Some(me));
            drop(accepted);
        }
    }

    #[test]
    fn an_ipv4_client_of_a_dual_stack_listener_is_found_by_its_mapped_address() {
        let Ok(listener) = std::net::TcpListener::bind("[::]:0") else {
            return;
        };
        let port = listener.local_addr().unwrap().port();
        let client = std::net::TcpStream::connect(("127.0.0.1", port)).unwrap();
        let (accepted, peer) = listener.accept().unwrap();
        assert!(matches!(peer.ip(), IpAddr::V6(v6) if v6.to_ipv4_mapped().is_some()));
        let local = accepted.local_addr().unwrap();
        assert_eq!(
            owner(peer, local).unwrap(),
            Some(nix::unistd::geteuid().as_raw())
        );
        drop(client);
    }

    #[test]
    fn no_socket_no_owner() {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let server = listener.local_addr().unwrap();
        // A port nothing is connected from.
        let nobody = SocketAddr::from(([127, 0, 0, 1], 1));
        assert_eq!(owner(nobody, server).unwrap(), None);
        // Different families never match.
        let v6: SocketAddr = "[::1]:1".parse().unwrap();
        assert_eq!(owner(v6, server).unwrap(), None);
    }
}
