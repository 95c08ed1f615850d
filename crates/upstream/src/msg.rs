//! The few header bytes this crate reads and writes itself (RFC 1035 §4.1.1), and the rule for
//! accepting a reply. Everything about questions is `nodedns_wire`'s.

use nodedns_wire::{HEADER_LEN, flags, rtype};

/// The message ID (RFC 1035 §4.1.1). `msg` must hold a header.
pub(crate) fn id(msg: &[u8]) -> u16 {
    u16::from_be_bytes([msg[0], msg[1]])
}

/// Overwrites the message ID. `msg` must hold a header.
pub(crate) fn set_id(msg: &mut [u8], id: u16) {
    msg[..2].copy_from_slice(&id.to_be_bytes());
}

fn header_flags(msg: &[u8]) -> u16 {
    u16::from_be_bytes([msg[2], msg[3]])
}

/// QR: the message is a response. `msg` must hold a header.
pub(crate) fn is_response(msg: &[u8]) -> bool {
    header_flags(msg) & flags::QR != 0
}

/// TC: the upstream cut the reply short, retry over TCP (RFC 7766 §5). `msg` must hold a header.
pub(crate) fn truncated(msg: &[u8]) -> bool {
    header_flags(msg) & flags::TC != 0
}

/// The header's 4-bit RCODE. `msg` must hold a header.
pub(crate) fn rcode(msg: &[u8]) -> u16 {
    header_flags(msg) & flags::RCODE_MASK
}

/// A query nodedns can forward: a whole header, not a response, and small enough for a TCP
/// length prefix. The question itself is the upstream's business (and `same_question`'s).
pub(crate) fn forwardable(query: &[u8]) -> bool {
    query.len() >= HEADER_LEN && query.len() <= usize::from(u16::MAX) && !is_response(query)
}

/// What a reply must carry to be accepted.
#[derive(Debug, Clone, Copy)]
pub(crate) enum Check<'a> {
    /// An answer to this query: same question (names compared case-insensitively).
    Answer(&'a [u8]),
    /// A health check: any response counts, whatever its question or RCODE (as CoreDNS).
    Alive,
}

impl Check<'_> {
    /// Whether `reply` answers the exchange that used `id`.
    pub(crate) fn accepts(self, reply: &[u8], id: u16) -> bool {
        if reply.len() < HEADER_LEN || self::id(reply) != id || !is_response(reply) {
            return false;
        }
        match self {
            Check::Answer(query) => nodedns_wire::same_question(query, reply),
            Check::Alive => true,
        }
    }
}

/// The health-check query `. IN NS` with RD set (what CoreDNS's forward sends).
pub(crate) fn probe(id: u16) -> [u8; HEADER_LEN + 5] {
    let mut msg = [0u8; HEADER_LEN + 5];
    set_id(&mut msg, id);
    msg[2..4].copy_from_slice(&flags::RD.to_be_bytes());
    msg[4..6].copy_from_slice(&1u16.to_be_bytes()); // QDCOUNT
    // msg[12] = 0: the root name.
    msg[13..15].copy_from_slice(&rtype::NS.to_be_bytes());
    msg[15..17].copy_from_slice(&1u16.to_be_bytes()); // class IN
    msg
}

/// `msg` with its TCP length prefix (RFC 1035 §4.2.2) and ID `id`, in one buffer so it leaves in
/// one segment (`TCP_NODELAY` is set). `msg` must be [`forwardable`].
pub(crate) fn framed(msg: &[u8], id: u16) -> Vec<u8> {
    let mut out = Vec::with_capacity(msg.len() + 2);
    // `forwardable` bounds the length to u16.
    out.extend_from_slice(&(msg.len() as u16).to_be_bytes());
    out.extend_from_slice(msg);
    set_id(&mut out[2..], id);
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use hickory_proto::op::Message;
    use hickory_proto::rr::RecordType;

    #[test]
    fn probe_is_root_ns_with_recursion_desired() {
        let msg = Message::from_vec(&probe(0x1234)).expect("probe decodes");
        assert_eq!(msg.metadata.id, 0x1234);
        assert!(msg.metadata.recursion_desired);
        assert_eq!(msg.queries.len(), 1);
        assert!(msg.queries[0].name().is_root());
        assert_eq!(msg.queries[0].query_type(), RecordType::NS);
    }

    #[test]
    fn framing_prefixes_the_length_and_replaces_the_id() {
        let msg = probe(1);
        let out = framed(&msg, 0xbeef);
        assert_eq!(&out[..2], &(msg.len() as u16).to_be_bytes());
        assert_eq!(id(&out[2..]), 0xbeef);
        assert_eq!(&out[4..], &msg[2..]);
    }

    #[test]
    fn alive_check_wants_the_id_and_qr_only() {
        let mut reply = probe(7);
        assert!(!Check::Alive.accepts(&reply, 7), "a query is not a reply");
        reply[2] |= 0x80; // QR
        assert!(Check::Alive.accepts(&reply, 7));
        assert!(!Check::Alive.accepts(&reply, 8));
        assert!(!Check::Alive.accepts(&reply[..5], 7), "no header");
    }

    #[test]
    fn only_queries_of_sane_length_are_forwardable() {
        let mut q = probe(1).to_vec();
        assert!(forwardable(&q));
        assert!(!forwardable(&q[..11]));
        q[2] |= 0x80;
        assert!(!forwardable(&q));
        assert!(!forwardable(&vec![0u8; 65536]));
    }
}
