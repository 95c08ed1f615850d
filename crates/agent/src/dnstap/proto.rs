//! The dnstap protobuf message (`dnstap.proto` of the dnstap project, proto2), written by hand:
//! nodedns writes two messages, a dozen fields, and never reads them back.
//!
//! Protobuf encoding (the Protocol Buffers "Encoding" guide): each field is a key, the varint
//! `field_number << 3 | wire_type`, then the value: wire type 0 a varint, 2 a varint length and
//! the bytes, 5 four little-endian bytes. An embedded message is a length-delimited field.

use std::net::IpAddr;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

/// `Dnstap.Type.MESSAGE`.
const DNSTAP_MESSAGE: u64 = 1;

/// `Message.Type` values nodedns writes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    ClientQuery = 5,
    ClientResponse = 6,
}

/// `SocketProtocol`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Transport {
    Udp = 1,
    Tcp = 2,
}

// Field numbers of `Dnstap`.
const IDENTITY: u32 = 1;
const VERSION: u32 = 2;
const EXTRA: u32 = 3;
const MESSAGE: u32 = 14;
const TYPE: u32 = 15;

// Field numbers of `Message`.
const M_TYPE: u32 = 1;
const M_SOCKET_FAMILY: u32 = 2;
const M_SOCKET_PROTOCOL: u32 = 3;
const M_QUERY_ADDRESS: u32 = 4;
const M_QUERY_PORT: u32 = 6;
const M_QUERY_TIME_SEC: u32 = 8;
const M_QUERY_TIME_NSEC: u32 = 9;
const M_QUERY_MESSAGE: u32 = 10;
const M_RESPONSE_TIME_SEC: u32 = 12;
const M_RESPONSE_TIME_NSEC: u32 = 13;
const M_RESPONSE_MESSAGE: u32 = 14;

/// What a `Dnstap` frame says about one client query or response.
#[derive(Debug, Clone, Copy)]
pub struct Event<'a> {
    pub kind: Kind,
    pub transport: Transport,
    /// The client's address and port (`query_address`, `query_port`).
    pub client: (IpAddr, u16),
    pub query_time: SystemTime,
    /// Set on responses.
    pub response_time: Option<SystemTime>,
    /// The DNS message in wire form (`query_message` or `response_message`), with `full`.
    pub message: Option<&'a [u8]>,
}

/// The fields every frame of one tap carries.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Header {
    pub identity: Vec<u8>,
    pub version: Vec<u8>,
    pub extra: Option<Vec<u8>>,
}

fn varint(out: &mut Vec<u8>, mut v: u64) {
    while v >= 0x80 {
        out.push((v as u8) | 0x80);
        v >>= 7;
    }
    out.push(v as u8);
}

fn key(out: &mut Vec<u8>, field: u32, wire_type: u8) {
    varint(out, u64::from(field) << 3 | u64::from(wire_type));
}

fn uint(out: &mut Vec<u8>, field: u32, v: u64) {
    key(out, field, 0);
    varint(out, v);
}

fn bytes(out: &mut Vec<u8>, field: u32, v: &[u8]) {
    key(out, field, 2);
    varint(out, v.len() as u64);
    out.extend_from_slice(v);
}

fn fixed32(out: &mut Vec<u8>, field: u32, v: u32) {
    key(out, field, 5);
    out.extend_from_slice(&v.to_le_bytes());
}

fn since_epoch(t: SystemTime) -> Duration {
    t.duration_since(UNIX_EPOCH).unwrap_or_default()
}

/// Appends one `Dnstap` message (type MESSAGE) for `event` to `out`; `scratch` holds the
/// embedded `Message` while it is measured.
pub fn encode(header: &Header, event: &Event<'_>, scratch: &mut Vec<u8>, out: &mut Vec<u8>) {
    scratch.clear();
    let m = scratch;
    uint(m, M_TYPE, event.kind as u64);
    let (ip, port) = event.client;
    // An IPv4 client on an IPv6 socket is reported as IPv4, as CoreDNS does.
    let ip = match ip {
        IpAddr::V6(v6) => v6.to_ipv4_mapped().map_or(ip, IpAddr::V4),
        v4 => v4,
    };
    match ip {
        IpAddr::V4(v4) => {
            uint(m, M_SOCKET_FAMILY, 1);
            uint(m, M_SOCKET_PROTOCOL, event.transport as u64);
            bytes(m, M_QUERY_ADDRESS, &v4.octets());
        }
        IpAddr::V6(v6) => {
            uint(m, M_SOCKET_FAMILY, 2);
            uint(m, M_SOCKET_PROTOCOL, event.transport as u64);
            bytes(m, M_QUERY_ADDRESS, &v6.octets());
        }
    }
    uint(m, M_QUERY_PORT, u64::from(port));
    let q = since_epoch(event.query_time);
    uint(m, M_QUERY_TIME_SEC, q.as_secs());
    fixed32(m, M_QUERY_TIME_NSEC, q.subsec_nanos());
    match (event.kind, event.message) {
        (Kind::ClientQuery, Some(msg)) => bytes(m, M_QUERY_MESSAGE, msg),
        (Kind::ClientResponse, Some(msg)) => bytes(m, M_RESPONSE_MESSAGE, msg),
        (_, None) => {}
    }
    if let Some(t) = event.response_time {
        let r = since_epoch(t);
        uint(m, M_RESPONSE_TIME_SEC, r.as_secs());
        fixed32(m, M_RESPONSE_TIME_NSEC, r.subsec_nanos());
    }
    bytes(out, IDENTITY, &header.identity);
    bytes(out, VERSION, &header.version);
    if let Some(extra) = &header.extra {
        bytes(out, EXTRA, extra);
    }
    bytes(out, MESSAGE, m);
    uint(out, TYPE, DNSTAP_MESSAGE);
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    /// A minimal protobuf reader for the tests: (field, wire type, value bytes or varint).
    pub(crate) fn fields(mut buf: &[u8]) -> Vec<(u32, u64, Vec<u8>)> {
        fn read_varint(buf: &mut &[u8]) -> u64 {
            let mut v = 0u64;
            for shift in (0..64).step_by(7) {
                let b = buf[0];
                *buf = &buf[1..];
                v |= u64::from(b & 0x7f) << shift;
                if b < 0x80 {
                    break;
                }
            }
            v
        }
        let mut out = Vec::new();
        while !buf.is_empty() {
            let k = read_varint(&mut buf);
            let (field, wire) = ((k >> 3) as u32, k & 7);
            match wire {
                0 => out.push((field, read_varint(&mut buf), Vec::new())),
                2 => {
                    let len = read_varint(&mut buf) as usize;
                    out.push((field, len as u64, buf[..len].to_vec()));
                    buf = &buf[len..];
                }
                5 => {
                    out.push((
                        field,
                        u64::from(u32::from_le_bytes(buf[..4].try_into().unwrap())),
                        Vec::new(),
                    ));
                    buf = &buf[4..];
                }
                other => panic!("wire type {other}"),
            }
        }
        out
    }

    #[test]
    fn varints_take_seven_bits_a_byte() {
        let mut out = Vec::new();
        varint(&mut out, 1);
        varint(&mut out, 300);
        varint(&mut out, u64::MAX);
        assert_eq!(&out[..3], [0x01, 0xac, 0x02]);
        assert_eq!(out.len(), 3 + 10);
    }

    #[test]
    fn a_client_response_has_the_fields_coredns_writes() {
        let header = Header {
            identity: b"node-1".to_vec(),
            version: b"nodedns-0.1.0".to_vec(),
            extra: None,
        };
        let t0 = UNIX_EPOCH + Duration::new(1_700_000_000, 5);
        let event = Event {
            kind: Kind::ClientResponse,
            transport: Transport::Udp,
            client: ("::ffff:127.0.0.2".parse().unwrap(), 40000),
            query_time: t0,
            response_time: Some(t0 + Duration::from_micros(20)),
            message: Some(b"\x12\x34answer"),
        };
        let (mut scratch, mut out) = (Vec::new(), Vec::new());
        encode(&header, &event, &mut scratch, &mut out);
        let top = fields(&out);
        assert_eq!(top[0], (IDENTITY, 6, b"node-1".to_vec()));
        assert_eq!(top[1].0, VERSION);
        assert_eq!(top[2].0, MESSAGE);
        assert_eq!(top[3], (TYPE, 1, Vec::new()));
        let m = fields(&top[2].2);
        let get = |f: u32| m.iter().find(|x| x.0 == f).cloned().unwrap();
        assert_eq!(get(M_TYPE).1, 6);
        assert_eq!(get(M_SOCKET_FAMILY).1, 1, "a mapped address is IPv4");
        assert_eq!(get(M_SOCKET_PROTOCOL).1, 1);
        assert_eq!(get(M_QUERY_ADDRESS).2, [127, 0, 0, 2]);
        assert_eq!(get(M_QUERY_PORT).1, 40000);
        assert_eq!(get(M_QUERY_TIME_SEC).1, 1_700_000_000);
        assert_eq!(get(M_QUERY_TIME_NSEC).1, 5);
        assert_eq!(get(M_RESPONSE_TIME_NSEC).1, 20_005);
        assert_eq!(get(M_RESPONSE_MESSAGE).2, b"\x12\x34answer");
        assert!(!m.iter().any(|x| x.0 == M_QUERY_MESSAGE));
    }
}
