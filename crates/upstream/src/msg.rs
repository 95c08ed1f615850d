//! The rule for accepting a reply, and the framing of what this crate sends. Header fields,
//! questions and the health check's query are `nodedns_wire`'s.

use nodedns_wire::Header;

/// A query nodedns can forward: a whole header, not a response, and small enough for a TCP
/// length prefix. The question itself is the upstream's business (and `same_question`'s).
pub(crate) fn forwardable(query: &[u8]) -> bool {
    query.len() <= usize::from(u16::MAX) && Header::read(query).is_some_and(|h| !h.is_response())
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
        let Some(header) = Header::read(reply) else {
            return false;
        };
        if header.id() != id || !header.is_response() {
            return false;
        }
        match self {
            Check::Answer(query) => nodedns_wire::same_question(query, reply),
            Check::Alive => true,
        }
    }
}

/// `msg` with its TCP length prefix (RFC 1035 §4.2.2) and ID `id`, in one buffer so it leaves in
/// one segment (`TCP_NODELAY` is set). `msg` must be [`forwardable`].
pub(crate) fn framed(msg: &[u8], id: u16) -> Vec<u8> {
    let mut out = Vec::with_capacity(msg.len() + 2);
    frame_into(&mut out, msg, id);
    out
}

/// [`framed`] into `out` (cleared first), whose room a connection keeps between its exchanges.
pub(crate) fn frame_into(out: &mut Vec<u8>, msg: &[u8], id: u16) {
    out.clear();
    // `forwardable` bounds the length to u16.
    out.extend_from_slice(&(msg.len() as u16).to_be_bytes());
    out.extend_from_slice(msg);
    if let Some(msg) = out.get_mut(2..) {
        nodedns_wire::set_id(msg, id);
    }
}

/// The header's RCODE of a reply this crate accepted (it has a header).
pub(crate) fn rcode(reply: &[u8]) -> u8 {
    Header::read(reply).map_or(0, |h| h.rcode())
}

/// Whether a reply has TC set: it did not fit a datagram (RFC 7766 §5).
pub(crate) fn truncated(reply: &[u8]) -> bool {
    Header::read(reply).is_some_and(|h| h.truncated())
}

#[cfg(test)]
mod tests {
    use nodedns_wire::root_ns_query;

    use super::*;

    #[test]
    fn framing_prefixes_the_length_and_replaces_the_id() {
        let msg = root_ns_query(1);
        let out = framed(&msg, 0xbeef);
        assert_eq!(&out[..2], &(msg.len() as u16).to_be_bytes());
        assert_eq!(Header::read(&out[2..]).unwrap().id(), 0xbeef);
        assert_eq!(&out[4..], &msg[2..]);
    }

    #[test]
    fn alive_check_wants_the_id_and_qr_only() {
        let mut reply = root_ns_query(7);
        assert!(!Check::Alive.accepts(&reply, 7), "a query is not a reply");
        reply[2] |= 0x80; // QR
        assert!(Check::Alive.accepts(&reply, 7));
        assert!(!Check::Alive.accepts(&reply, 8));
        assert!(!Check::Alive.accepts(&reply[..5], 7), "no header");
    }

    #[test]
    fn only_queries_of_sane_length_are_forwardable() {
        let mut q = root_ns_query(1).to_vec();
        assert!(forwardable(&q));
        assert!(!forwardable(&q[..11]));
        q[2] |= 0x80;
        assert!(!forwardable(&q));
        assert!(!forwardable(&vec![0u8; 65536]));
    }
}
