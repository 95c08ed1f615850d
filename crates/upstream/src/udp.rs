//! One exchange over UDP (`prefer_udp`).
//!
//! Each exchange gets its own connected socket on an ephemeral port: the kernel picks a random
//! source port, which with the random ID is what makes a spoofed reply hard to land (RFC 5452
//! §4.5), and `connect` makes the kernel drop datagrams from any other source. A datagram that
//! still does not match (wrong ID or question) is ignored and the wait goes on, so a stray or
//! spoofed packet cannot end the exchange.

use std::net::{Ipv4Addr, Ipv6Addr, SocketAddr};

use tokio::net::UdpSocket;

use nodedns_wire::set_id;

use crate::msg::Check;
use crate::pool::Fault;

/// Largest datagram: reading into anything smaller could cut a reply short without notice.
const MAX_DATAGRAM: usize = 65535;

/// Sends `msg` to `addr` with a random ID and waits for a reply `check` accepts, as long as the
/// caller lets it (no timer of its own).
pub(crate) async fn exchange(
    addr: SocketAddr,
    msg: &[u8],
    check: Check<'_>,
) -> Result<Vec<u8>, Fault> {
    let local: SocketAddr = if addr.is_ipv4() {
        (Ipv4Addr::UNSPECIFIED, 0).into()
    } else {
        (Ipv6Addr::UNSPECIFIED, 0).into()
    };
    let id = rand::random();
    let mut out = msg.to_vec();
    set_id(&mut out, id);
    let io = async {
        let socket = UdpSocket::bind(local).await?;
        socket.connect(addr).await?;
        socket.send(&out).await?;
        let mut buf = vec![0u8; MAX_DATAGRAM];
        loop {
            let n = socket.recv(&mut buf).await?;
            if check.accepts(&buf[..n], id) {
                buf.truncate(n);
                return Ok::<_, std::io::Error>(buf);
            }
            tracing::debug!(upstream = %addr, "ignored a UDP datagram that does not answer the query");
        }
    };
    match io.await {
        // ICMP port or host unreachable, reported on the connected socket.
        Err(_) => Err(Fault::Refused),
        Ok(mut reply) => {
            reply.shrink_to_fit();
            Ok(reply)
        }
    }
}
