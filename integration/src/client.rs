//! Clients: raw queries over UDP and TCP decoded with hickory-proto (the oracle, independent of
//! nodedns's own wire code), several queries pipelined on one TCP connection, and runs of the
//! real clients `dig` and `kdig` with their output parsed.

use std::net::{Ipv4Addr, Ipv6Addr, SocketAddr};
use std::process::Command;
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use hickory_proto::op::{Edns, Message, MessageType, Query};
use hickory_proto::rr::{Name, RData, RecordType};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpStream, UdpSocket};

/// How long the async helpers wait for an answer before failing.
pub const TIMEOUT: Duration = Duration::from_secs(5);

/// A query for `name`/`rtype` (class IN) with RD set, a random ID and no OPT record.
/// `name` keeps its case exactly (for 0x20 tests). Panics on a name hickory cannot parse: test
/// names are literals.
pub fn query(name: &str, rtype: RecordType) -> Message {
    let mut message = Message::query();
    message.metadata.recursion_desired = true;
    let name = Name::from_ascii(name).unwrap_or_else(|e| panic!("bad test name {name:?}: {e}"));
    message.add_query(Query::query(name, rtype));
    message
}

/// [`query`] with an OPT record advertising `udp_size` (EDNS version 0, DO clear).
pub fn query_edns(name: &str, rtype: RecordType, udp_size: u16) -> Message {
    let mut message = query(name, rtype);
    let mut edns = Edns::new();
    edns.set_max_payload(udp_size);
    message.set_edns(edns);
    message
}

fn encode(message: &Message) -> anyhow::Result<Vec<u8>> {
    message.to_vec().context("encode query")
}

/// Decodes a reply with hickory-proto.
pub fn decode(bytes: &[u8]) -> anyhow::Result<Message> {
    Message::from_vec(bytes).map_err(|e| anyhow::anyhow!("undecodable reply ({e}): {bytes:02x?}"))
}

/// The reply is a response to `query`: QR set, same ID, same question (names compared
/// case-insensitively here; tests about case compare the names themselves).
fn answers(query: &Message, reply: &Message) -> bool {
    reply.metadata.message_type == MessageType::Response
        && reply.metadata.id == query.metadata.id
        && reply.queries == query.queries
}

fn unspecified_for(addr: SocketAddr) -> SocketAddr {
    if addr.is_ipv4() {
        (Ipv4Addr::UNSPECIFIED, 0).into()
    } else {
        (Ipv6Addr::UNSPECIFIED, 0).into()
    }
}

/// Sends `query` over UDP from a fresh socket and returns the decoded reply, waiting at most
/// `timeout`. Datagrams that do not answer the query (other ID or question) are ignored.
pub fn udp_blocking(
    server: SocketAddr,
    query: &Message,
    timeout: Duration,
) -> anyhow::Result<Message> {
    let socket = std::net::UdpSocket::bind(unspecified_for(server))?;
    socket.send_to(&encode(query)?, server)?;
    let deadline = Instant::now() + timeout;
    let mut buf = vec![0; 65535];
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            bail!("no UDP answer from {server} within {timeout:?}");
        }
        socket.set_read_timeout(Some(left))?;
        let (n, from) = match socket.recv_from(&mut buf) {
            Ok(got) => got,
            Err(e)
                if matches!(
                    e.kind(),
                    std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
                ) =>
            {
                bail!("no UDP answer from {server} within {timeout:?}")
            }
            Err(e) => return Err(e.into()),
        };
        if from != server {
            continue;
        }
        if let Ok(reply) = decode(&buf[..n])
            && answers(query, &reply)
        {
            return Ok(reply);
        }
    }
}

/// Sends `query` over UDP and returns the decoded reply (at most [`TIMEOUT`]).
pub async fn udp(server: SocketAddr, query: &Message) -> anyhow::Result<Message> {
    let bytes = udp_exchange(server, &encode(query)?, TIMEOUT)
        .await?
        .with_context(|| format!("no UDP answer from {server} within {TIMEOUT:?}"))?;
    let reply = decode(&bytes)?;
    if !answers(query, &reply) {
        bail!("UDP reply does not match the query: {reply:?}");
    }
    Ok(reply)
}

/// Sends `query` over UDP and returns the raw reply bytes (for size and TC checks).
pub async fn udp_bytes(server: SocketAddr, query: &Message) -> anyhow::Result<Vec<u8>> {
    udp_exchange(server, &encode(query)?, TIMEOUT)
        .await?
        .with_context(|| format!("no UDP answer from {server} within {TIMEOUT:?}"))
}

/// Sends raw `bytes` from a fresh UDP socket and returns the first datagram that comes back
/// from `server` within `wait`, or `None` if none does (for garbage that must go unanswered).
pub async fn udp_exchange(
    server: SocketAddr,
    bytes: &[u8],
    wait: Duration,
) -> anyhow::Result<Option<Vec<u8>>> {
    let socket = UdpSocket::bind(unspecified_for(server)).await?;
    socket.send_to(bytes, server).await?;
    let mut buf = vec![0; 65535];
    let deadline = tokio::time::Instant::now() + wait;
    loop {
        match tokio::time::timeout_at(deadline, socket.recv_from(&mut buf)).await {
            Err(_) => return Ok(None),
            Ok(Err(e)) => return Err(e.into()),
            Ok(Ok((n, from))) if from == server => return Ok(Some(buf[..n].to_vec())),
            Ok(Ok(_)) => continue,
        }
    }
}

/// Writes one DNS message on a TCP stream with its two-byte length prefix (RFC 1035 §4.2.2).
pub async fn write_frame(stream: &mut TcpStream, bytes: &[u8]) -> anyhow::Result<()> {
    let len = u16::try_from(bytes.len()).context("message over 65535 bytes")?;
    let mut framed = Vec::with_capacity(bytes.len() + 2);
    framed.extend_from_slice(&len.to_be_bytes());
    framed.extend_from_slice(bytes);
    stream.write_all(&framed).await?;
    Ok(())
}

/// Reads one length-prefixed DNS message from a TCP stream.
pub async fn read_frame(stream: &mut TcpStream) -> anyhow::Result<Vec<u8>> {
    let len = stream.read_u16().await.context("read length prefix")?;
    let mut bytes = vec![0; usize::from(len)];
    stream
        .read_exact(&mut bytes)
        .await
        .context("read message")?;
    Ok(bytes)
}

/// Sends `query` over a new TCP connection and returns the decoded reply (at most [`TIMEOUT`]).
pub async fn tcp(server: SocketAddr, query: &Message) -> anyhow::Result<Message> {
    let replies = tcp_pipelined(server, std::slice::from_ref(query)).await?;
    replies.into_iter().next().context("no TCP reply")
}

/// Writes all `queries` on one TCP connection in a single write (pipelined, RFC 7766 §6.2.1.1),
/// then reads as many replies, in the order they arrive (which RFC 7766 lets differ from the
/// order sent). At most [`TIMEOUT`] in all.
pub async fn tcp_pipelined(
    server: SocketAddr,
    queries: &[Message],
) -> anyhow::Result<Vec<Message>> {
    let work = async {
        let mut stream = TcpStream::connect(server).await?;
        let mut framed = Vec::new();
        for query in queries {
            let bytes = encode(query)?;
            framed.extend_from_slice(&u16::try_from(bytes.len())?.to_be_bytes());
            framed.extend_from_slice(&bytes);
        }
        stream.write_all(&framed).await?;
        let mut replies = Vec::with_capacity(queries.len());
        for _ in queries {
            replies.push(decode(&read_frame(&mut stream).await?)?);
        }
        anyhow::Ok(replies)
    };
    tokio::time::timeout(TIMEOUT, work)
        .await
        .with_context(|| format!("TCP exchange with {server} took over {TIMEOUT:?}"))?
}

/// The question name of a message as sent on the wire, case preserved.
pub fn qname(message: &Message) -> String {
    message
        .queries
        .first()
        .map(|q| q.name().to_ascii())
        .unwrap_or_default()
}

/// The TTLs of the answer section's records, in order.
pub fn answer_ttls(message: &Message) -> Vec<u32> {
    message.answers.iter().map(|r| r.ttl).collect()
}

/// The TTLs of the authority section's records, in order.
pub fn authority_ttls(message: &Message) -> Vec<u32> {
    message.authorities.iter().map(|r| r.ttl).collect()
}

/// The addresses of the answer section's A records, in order.
pub fn a_addrs(message: &Message) -> Vec<Ipv4Addr> {
    message
        .answers
        .iter()
        .filter_map(|r| match &r.data {
            RData::A(a) => Some(a.0),
            _ => None,
        })
        .collect()
}

/// One resource record as `dig`/`kdig` print it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DigRecord {
    pub name: String,
    pub ttl: u32,
    pub class: String,
    pub rtype: String,
    /// The RDATA in presentation form, fields separated by one space.
    pub data: String,
}

/// What a `dig` or `kdig` run printed, parsed.
#[derive(Debug, Clone, Default)]
pub struct DigOutput {
    /// The RCODE name (`NOERROR`, `NXDOMAIN`, `SERVFAIL`, ...).
    pub status: String,
    /// Header flags, lowercase (`qr`, `aa`, `tc`, `rd`, `ra`, ...).
    pub flags: Vec<String>,
    /// The UDP size the reply's OPT advertised, `None` if it had no OPT.
    pub edns_udp: Option<u16>,
    pub answers: Vec<DigRecord>,
    pub authority: Vec<DigRecord>,
    /// The full output, for assertion messages.
    pub raw: String,
}

impl DigOutput {
    pub fn has_flag(&self, flag: &str) -> bool {
        self.flags.iter().any(|f| f == flag)
    }

    /// Parses the output of `dig` (BIND 9) or `kdig` (Knot). Fails if it holds no reply header.
    pub fn parse(raw: &str) -> anyhow::Result<DigOutput> {
        let mut out = DigOutput {
            raw: raw.to_owned(),
            ..DigOutput::default()
        };
        let mut section: Option<&str> = None;
        let mut header = false;
        for line in raw.lines() {
            let trimmed = line.trim();
            if trimmed.is_empty() {
                section = None;
                continue;
            }
            let lower = trimmed.to_ascii_lowercase();
            if let Some(at) = lower.find("status:") {
                // dig: "opcode: QUERY, status: NOERROR, id: 1"; kdig: "...; status: NOERROR; id: 1"
                let rest = &trimmed[at + "status:".len()..];
                out.status = rest
                    .split([',', ';'])
                    .next()
                    .unwrap_or("")
                    .trim()
                    .to_owned();
                header = true;
                continue;
            }
            if let Some(rest) = lower.strip_prefix(";; flags:") {
                out.flags = rest
                    .split(';')
                    .next()
                    .unwrap_or("")
                    .split_whitespace()
                    .map(str::to_owned)
                    .collect();
                continue;
            }
            // dig: "; EDNS: version: 0, flags:; udp: 1232"; kdig: ";; Version: 0; flags: ; UDP size: 1232 B; ..."
            if lower.contains("edns: version") || lower.starts_with(";; version:") {
                let size = lower
                    .split_once("udp:")
                    .or_else(|| lower.split_once("udp size:"))
                    .and_then(|(_, rest)| {
                        rest.trim_start()
                            .split(|c: char| !c.is_ascii_digit())
                            .next()
                            .and_then(|n| n.parse().ok())
                    });
                out.edns_udp = size;
                continue;
            }
            if lower.starts_with(";; answer section") {
                section = Some("answer");
                continue;
            }
            if lower.starts_with(";; authority section") {
                section = Some("authority");
                continue;
            }
            if trimmed.starts_with(';') {
                if lower.ends_with("section:") {
                    section = Some("other");
                }
                continue;
            }
            let fields: Vec<&str> = trimmed.split_whitespace().collect();
            let record = match fields.as_slice() {
                [name, ttl, class, rtype, data @ ..] => match ttl.parse() {
                    Ok(ttl) => DigRecord {
                        name: (*name).to_owned(),
                        ttl,
                        class: (*class).to_owned(),
                        rtype: (*rtype).to_owned(),
                        data: data.join(" "),
                    },
                    Err(_) => continue,
                },
                _ => continue,
            };
            match section {
                Some("answer") => out.answers.push(record),
                Some("authority") => out.authority.push(record),
                _ => {}
            }
        }
        if !header {
            bail!("no reply header in output:\n{raw}");
        }
        Ok(out)
    }
}

/// Runs `dig @server -p port +tries=1 +time=3 <args>` (optionally inside network namespace
/// `netns`) and parses what it printed.
pub fn dig_in(netns: Option<&str>, server: SocketAddr, args: &[&str]) -> anyhow::Result<DigOutput> {
    run_client(netns, "dig", &["+tries=1", "+time=3"], server, args)
}

/// [`dig_in`] in the current network namespace.
pub fn dig(server: SocketAddr, args: &[&str]) -> anyhow::Result<DigOutput> {
    dig_in(None, server, args)
}

/// Runs `kdig @server -p port +retry=0 +time=3 <args>` (optionally inside `netns`) and parses
/// what it printed.
pub fn kdig_in(
    netns: Option<&str>,
    server: SocketAddr,
    args: &[&str],
) -> anyhow::Result<DigOutput> {
    run_client(netns, "kdig", &["+retry=0", "+time=3"], server, args)
}

/// [`kdig_in`] in the current network namespace.
pub fn kdig(server: SocketAddr, args: &[&str]) -> anyhow::Result<DigOutput> {
    kdig_in(None, server, args)
}

fn run_client(
    netns: Option<&str>,
    program: &str,
    defaults: &[&str],
    server: SocketAddr,
    args: &[&str],
) -> anyhow::Result<DigOutput> {
    let mut command = match netns {
        Some(ns) => {
            let mut c = Command::new("ip");
            c.args(["netns", "exec", ns, program]);
            c
        }
        None => Command::new(program),
    };
    command
        .arg(format!("@{}", server.ip()))
        .arg("-p")
        .arg(server.port().to_string())
        .args(defaults)
        .args(args);
    let output = command.output().with_context(|| format!("run {program}"))?;
    let text = String::from_utf8_lossy(&output.stdout).into_owned()
        + &String::from_utf8_lossy(&output.stderr);
    DigOutput::parse(&text).with_context(|| format!("{program} {args:?} ({})", output.status))
}
