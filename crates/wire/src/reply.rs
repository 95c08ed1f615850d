//! Upstream replies: validated and indexed once, then copied and patched for every hit.

use crate::octets::{get16, header};
use crate::{HEADER_LEN, Query, name};

/// An upstream reply ready to be served any number of times.
///
/// Holds the reply's bytes with the OPT record removed (OPT is hop-by-hop: RFC 6891 §6.1.1; the
/// answer to each client gets its own) and the offset of every TTL field, so a hit is a copy plus
/// a few patches, never a decode.
#[derive(Debug, Clone)]
pub struct Reply {
    bytes: Box<[u8]>,
    /// Offsets of the 32-bit TTL field of every record in the answer, authority and additional
    /// sections (OPT excluded: its TTL field holds flags, not a TTL).
    ttls: Box<[u16]>,
    info: Info,
}

/// What the cache needs to know about a reply to decide whether and how long to keep it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Info {
    /// The full RCODE: header bits, plus the OPT's extended bits when the reply had an OPT.
    pub rcode: u16,
    /// TC: the upstream cut the reply short.
    pub truncated: bool,
    /// AD from the upstream's header (kept, so a validating upstream's verdict is passed on).
    pub authentic_data: bool,
    /// ANCOUNT.
    pub answers: u16,
    /// Smallest TTL over all records in all sections (OPT excluded); `None` if there are none.
    pub min_ttl: Option<u32>,
    /// For negative caching (RFC 2308 §5): the first SOA in the authority section gives
    /// min(its TTL, its MINIMUM field). `None` if the authority section has no SOA.
    pub negative_ttl: Option<u32>,
}

/// Why an upstream reply cannot be used.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum ReplyError {
    #[error("shorter than a DNS header")]
    ShortHeader,
    #[error("QR bit clear: not a response")]
    NotResponse,
    #[error("question count is not 1")]
    QuestionCount,
    #[error("malformed name")]
    BadName,
    #[error("message ends inside a record")]
    Truncated,
    #[error("trailing bytes after the message")]
    TrailingBytes,
    /// More than one OPT, an OPT outside the additional section, or an OPT that is not the last
    /// record (removing it would move records that later compression pointers might target).
    #[error("misplaced OPT record")]
    BadOpt,
    #[error("larger than 65535 bytes")]
    TooLarge,
}

/// How the TTLs of a served copy are computed from the stored ones.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TtlRule {
    /// Seconds the entry has been in the cache: subtracted from every TTL (saturating at 0).
    pub age: u32,
    /// Upper bound for every TTL after the subtraction: the entry's remaining lifetime, so a TTL
    /// the cache clamped shorter is never advertised longer (and a stale answer gets RFC 8767's
    /// 30 s).
    pub cap: u32,
}

/// Whether two messages carry the same question, names compared case-insensitively
/// (RFC 4343). Used to accept an upstream reply only for the query that was sent.
///
/// Each message must hold exactly one question with an uncompressed name; anything else
/// compares unequal.
pub fn same_question(a: &[u8], b: &[u8]) -> bool {
    match (question(a), question(b)) {
        // Label length bytes are at most 63, below b'A', so a byte-wise ASCII case-insensitive
        // comparison compares the label structure exactly and the label text without case.
        (Some(a), Some(b)) => a.eq_ignore_ascii_case(b),
        _ => false,
    }
}

/// The question's bytes (name, type, class) of a message with QDCOUNT 1.
fn question(msg: &[u8]) -> Option<&[u8]> {
    if get16(msg, header::QDCOUNT)? != 1 {
        return None;
    }
    let name_end = name::skip_uncompressed(msg, HEADER_LEN).ok()?;
    msg.get(HEADER_LEN..name_end.checked_add(4)?)
}

impl Reply {
    /// Validates and indexes an upstream reply: QR set, exactly one question, every name and
    /// record inside the bytes (compression pointers point backwards, loops rejected), at most
    /// one OPT and only as the last record (it is removed and ARCOUNT lowered). Never panics.
    pub fn parse(bytes: &[u8]) -> Result<Self, ReplyError> {
        let _ = bytes;
        todo!()
    }

    pub fn info(&self) -> &Info {
        &self.info
    }

    /// The stored bytes (OPT removed). Also what the cache weighs an entry by.
    pub fn bytes(&self) -> &[u8] {
        &self.bytes
    }

    /// Bytes this reply holds on the heap (message plus TTL index), for the cache's weigher.
    pub fn heap_size(&self) -> usize {
        self.bytes.len() + self.ttls.len() * 2
    }

    /// Writes the answer to `query` into `out` (cleared first) and returns the TTL-patched copy's
    /// length: the stored bytes with the query's ID, RD bit and question bytes (so the client's
    /// name case comes back as sent), AA set (as CoreDNS's cache does), every TTL patched by
    /// `ttl`, and an OPT record advertising [`crate::EDNS_UDP_SIZE`] (DO echoed) only if the
    /// query had one. If the result exceeds `limit`, writes instead the header and question with
    /// TC set and no records (plus OPT), so the client retries over TCP (RFC 7766 §5).
    ///
    /// `query` must have the same key as the query this reply answers; the question bytes are
    /// copied from it.
    pub fn write_answer(&self, query: &Query<'_>, ttl: TtlRule, limit: usize, out: &mut Vec<u8>) {
        let _ = (query, ttl, limit, out);
        todo!()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn message(qdcount: u16, question: &[u8]) -> Vec<u8> {
        let mut msg = vec![0x12, 0x34, 0x81, 0x80, 0, 0, 0, 0, 0, 0, 0, 0];
        msg[4..6].copy_from_slice(&qdcount.to_be_bytes());
        msg.extend_from_slice(question);
        msg
    }

    #[test]
    fn same_question_ignores_name_case() {
        let a = message(1, b"\x07ExAmple\x03COM\x00\x00\x01\x00\x01");
        let b = message(1, b"\x07example\x03com\x00\x00\x01\x00\x01extra");
        assert!(same_question(&a, &b));
    }

    #[test]
    fn same_question_compares_type_class_and_labels() {
        let a = message(1, b"\x07example\x03com\x00\x00\x01\x00\x01");
        let other_type = message(1, b"\x07example\x03com\x00\x00\x1c\x00\x01");
        let other_class = message(1, b"\x07example\x03com\x00\x00\x01\x00\x03");
        let other_labels = message(1, b"\x07example\x02co\x01m\x00\x00\x01\x00\x01");
        assert!(!same_question(&a, &other_type));
        assert!(!same_question(&a, &other_class));
        assert!(!same_question(&a, &other_labels));
    }

    #[test]
    fn same_question_false_for_malformed_messages() {
        let a = message(1, b"\x07example\x03com\x00\x00\x01\x00\x01");
        assert!(!same_question(&a, &message(2, &a[12..])));
        assert!(!same_question(&a, &a[..a.len() - 1]));
        assert!(!same_question(&a, &a[..5]));
        assert!(!same_question(&message(1, b"\xc0\x0c\x00\x01\x00\x01"), &a));
    }
}
