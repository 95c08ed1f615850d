//! Another instance serving the same addresses on the node: a second DaemonSet (kubespray's
//! `nodelocaldns-second`), whose sockets join ours in each address's `SO_REUSEPORT` group, so
//! that the node keeps answering while one of the two restarts.
//!
//! - [`bound_elsewhere`]: which of our DNS addresses another process also holds a UDP socket
//!   on (from `/proc/net/udp` and `udp6` of this network namespace, minus the sockets among our
//!   own descriptors). An instance that finds one at shutdown is not the last: it leaves the
//!   link and the rules to the other.
//! - [`step_aside`]: before closing, it takes its UDP sockets out of their groups (a connected
//!   UDP socket is passed over when the kernel picks a group member for a datagram) and answers
//!   what is already queued on them, so a restart of one sibling loses no query. A TCP
//!   listener cannot leave its group: connections the kernel queued on it in the last instant
//!   before it closes are reset (`net.ipv4.tcp_migrate_req=1` hands them to the sibling).
//! - [`in_use`]: a bind that another socket's owner does not share, explained: a group is open
//!   only to sockets of the same effective UID that all set `SO_REUSEPORT`.

use std::collections::{BTreeSet, HashSet};
use std::io;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};
use std::os::fd::BorrowedFd;
use std::time::{Duration, Instant};

use socket2::SockRef;

/// `st` of an unconnected UDP socket in `/proc/net/udp` (`TCP_CLOSE`).
const UNCONNECTED: &str = "07";

/// The addresses of `addrs` on which a UDP socket that this process does not hold is bound and
/// unconnected: another instance serves them too.
pub fn bound_elsewhere(addrs: &BTreeSet<SocketAddr>) -> io::Result<BTreeSet<SocketAddr>> {
    let own = own_socket_inodes()?;
    let mut found = BTreeSet::new();
    for table in ["/proc/net/udp", "/proc/net/udp6"] {
        let text = match std::fs::read_to_string(table) {
            Ok(text) => text,
            // No IPv6 in this kernel: no IPv6 sockets either.
            Err(e) if e.kind() == io::ErrorKind::NotFound => continue,
            Err(e) => return Err(e),
        };
        for (addr, inode) in unconnected_sockets(&text) {
            if addrs.contains(&addr) && !own.contains(&inode) {
                found.insert(addr);
            }
        }
    }
    Ok(found)
}

/// (local address, inode) of every unconnected socket of a `/proc/net/udp{,6}` table.
fn unconnected_sockets(table: &str) -> impl Iterator<Item = (SocketAddr, u64)> + '_ {
    table.lines().skip(1).filter_map(|line| {
        let fields: Vec<&str> = line.split_whitespace().collect();
        if fields.get(3) != Some(&UNCONNECTED) {
            return None;
        }
        let addr = proc_addr(fields.get(1)?)?;
        let inode = fields.get(9)?.parse().ok()?;
        Some((addr, inode))
    })
}

/// `0A14FEA9:0035` (IPv4) or 32 hex digits and a port (IPv6): the kernel prints the address as
/// 32-bit words in the machine's byte order, the port in host order.
fn proc_addr(text: &str) -> Option<SocketAddr> {
    let (ip, port) = text.split_once(':')?;
    let port = u16::from_str_radix(port, 16).ok()?;
    let word = |i: usize| -> Option<[u8; 4]> {
        let hex = ip.get(i * 8..i * 8 + 8)?;
        Some(u32::from_str_radix(hex, 16).ok()?.to_ne_bytes())
    };
    let ip = match ip.len() {
        8 => IpAddr::V4(Ipv4Addr::from(word(0)?)),
        32 => {
            let mut bytes = [0u8; 16];
            for i in 0..4 {
                bytes[i * 4..i * 4 + 4].copy_from_slice(&word(i)?);
            }
            IpAddr::V6(Ipv6Addr::from(bytes))
        }
        _ => return None,
    };
    Some(SocketAddr::new(ip, port))
}

/// Inodes of the sockets among this process's descriptors (sockets handed over from or to
/// another instance are the same sockets in both: they count as ours).
fn own_socket_inodes() -> io::Result<HashSet<u64>> {
    let mut inodes = HashSet::new();
    for entry in std::fs::read_dir("/proc/self/fd")? {
        let Ok(target) = std::fs::read_link(entry?.path()) else {
            continue; // closed meanwhile
        };
        let target = target.to_string_lossy();
        if let Some(inode) = target
            .strip_prefix("socket:[")
            .and_then(|t| t.strip_suffix(']'))
            .and_then(|t| t.parse().ok())
        {
            inodes.insert(inode);
        }
    }
    Ok(inodes)
}

/// At shutdown: when another process serves some of `addrs` too, takes every socket of `udp`
/// out of its `SO_REUSEPORT` group and waits (up to `limit`) until what is queued on them has
/// been read, while the workers still answer. Returns whether another process serves: this
/// instance is then not the last on the node. Nothing is done when none does.
pub async fn step_aside(
    udp: &[BorrowedFd<'_>],
    addrs: &BTreeSet<SocketAddr>,
    limit: Duration,
) -> bool {
    let shared = match bound_elsewhere(addrs) {
        Ok(shared) => shared,
        Err(err) => {
            tracing::warn!(%err, "cannot tell whether another instance serves these addresses; taking this one for the last");
            return false;
        }
    };
    if shared.is_empty() {
        return false;
    }
    tracing::info!(addrs = ?shared, "another instance serves these addresses too: handing the queries to it");
    for fd in udp {
        if let Err(err) = leave_group(*fd) {
            tracing::warn!(%err, "UDP socket stays in its group until it closes");
        }
    }
    let deadline = Instant::now() + limit;
    while udp
        .iter()
        .any(|fd| rustix::io::ioctl_fionread(fd).is_ok_and(|n| n > 0))
        && Instant::now() < deadline
    {
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    true
}

/// Connects a UDP socket to its own address: no datagram comes from there, and Linux passes
/// connected sockets over when it picks a member of a reuse-port group, so new datagrams go to
/// the other members; what is queued stays readable, and answers still go to each client
/// (`sendmmsg` names the destination).
fn leave_group(fd: BorrowedFd<'_>) -> io::Result<()> {
    let socket = SockRef::from(&fd);
    let local = socket.local_addr()?;
    socket.connect(&local)
}

/// `err` from binding `addr`, explained when the address is held by a socket this one cannot
/// share.
pub fn in_use(addr: SocketAddr, err: io::Error) -> io::Error {
    if err.kind() != io::ErrorKind::AddrInUse {
        return err;
    }
    io::Error::new(
        io::ErrorKind::AddrInUse,
        format!(
            "{err}: another socket holds {addr} and does not share it. A second nodedns (or \
             node-cache) on the node may serve the same address only when both run as the same \
             user: SO_REUSEPORT groups are per effective UID. Any other server there (a local \
             resolver) must go"
        ),
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::net::UdpSocket;
    use std::os::fd::AsFd;

    #[test]
    fn proc_addresses_parse_in_the_kernels_layout() {
        // 169.254.20.10:53 and [fd00::10]:53, as an x86-64 kernel prints them.
        if cfg!(target_endian = "little") {
            assert_eq!(
                proc_addr("0A14FEA9:0035"),
                Some("169.254.20.10:53".parse().unwrap())
            );
            assert_eq!(
                proc_addr("000000FD000000000000000010000000:0035"),
                Some("[fd00::10]:53".parse().unwrap())
            );
        }
        for bad in [
            "",
            "0A14FEA9",
            "0A14FEA9:",
            "0A14FEA:0035",
            "zz14FEA9:0035",
            "0A14FEA9:10000",
        ] {
            assert_eq!(proc_addr(bad), None, "{bad}");
        }
    }

    #[test]
    fn only_unconnected_sockets_are_listed() {
        let table = "  sl  local_address rem_address   st tx_queue rx_queue tr tm->when retrnsmt   uid  timeout inode ref pointer drops\n\
             1: 0100007F:0035 00000000:0000 07 00000000:00000000 00:00000000 00000000     0        0 111 2 0000000000000000 0\n\
             2: 0100007F:0035 0100007F:1F90 01 00000000:00000000 00:00000000 00000000     0        0 222 2 0000000000000000 0\n\
           garbage\n";
        if cfg!(target_endian = "little") {
            let found: Vec<_> = unconnected_sockets(table).collect();
            assert_eq!(found, [("127.0.0.1:53".parse().unwrap(), 111)]);
        }
    }

    #[test]
    fn a_socket_of_this_process_is_not_another_instance() {
        let mine = UdpSocket::bind("127.0.0.1:0").unwrap();
        let addrs = BTreeSet::from([mine.local_addr().unwrap()]);
        assert!(bound_elsewhere(&addrs).unwrap().is_empty());
    }

    fn group_member(addr: SocketAddr) -> UdpSocket {
        let socket =
            socket2::Socket::new(socket2::Domain::IPV4, socket2::Type::DGRAM, None).unwrap();
        socket.set_reuse_port(true).unwrap();
        socket.bind(&addr.into()).unwrap();
        socket.set_nonblocking(true).unwrap();
        socket.into()
    }

    fn drain(socket: &UdpSocket) -> usize {
        let mut buf = [0u8; 16];
        std::iter::from_fn(|| socket.recv(&mut buf).ok()).count()
    }

    #[test]
    fn a_socket_that_left_its_group_keeps_its_queue_and_gets_nothing_new() {
        let first = group_member("127.0.0.1:0".parse().unwrap());
        let addr = first.local_addr().unwrap();
        let second = group_member(addr);
        // Clients on many ports: the kernel spreads them over both members by hash.
        let clients: Vec<UdpSocket> = (0..64)
            .map(|_| UdpSocket::bind("127.0.0.1:0").unwrap())
            .collect();
        for c in &clients {
            c.send_to(b"before", addr).unwrap();
        }
        let queued = rustix::io::ioctl_fionread(&first).unwrap();
        assert!(queued > 0, "some datagrams hashed to the first member");
        leave_group(first.as_fd()).unwrap();
        for c in &clients {
            c.send_to(b"after", addr).unwrap();
        }
        // What was queued on the first is still there; everything after went to the second.
        let (on_first, on_second) = (drain(&first), drain(&second));
        assert_eq!(on_first + on_second, 128);
        assert!(on_first > 0 && on_first < 64, "{on_first}");
        assert_eq!(on_second, 128 - on_first);
        // And an answer still goes to a client of its choosing.
        first
            .send_to(b"reply", clients[0].local_addr().unwrap())
            .unwrap();
        let mut buf = [0u8; 8];
        clients[0]
            .set_read_timeout(Some(Duration::from_secs(2)))
            .unwrap();
        assert_eq!(clients[0].recv(&mut buf).unwrap(), 5);
    }

    #[test]
    fn a_bind_refused_for_another_owner_says_why() {
        let err = in_use(
            "169.254.20.10:53".parse().unwrap(),
            io::Error::from(io::ErrorKind::AddrInUse),
        );
        assert_eq!(err.kind(), io::ErrorKind::AddrInUse);
        assert!(err.to_string().contains("per effective UID"), "{err}");
        let other = in_use(
            "169.254.20.10:53".parse().unwrap(),
            io::Error::from(io::ErrorKind::PermissionDenied),
        );
        assert_eq!(other.kind(), io::ErrorKind::PermissionDenied);
    }
}
