//! Client queries, parsed in place.

use crate::Key;

/// A client query: the raw bytes, with the header read and the question and OPT record located.
/// Parsing allocates nothing; every accessor reads the borrowed bytes.
#[derive(Debug, Clone, Copy)]
pub struct Query<'a> {
    bytes: &'a [u8],
}

/// The client's EDNS parameters, from its OPT record (RFC 6891 §6.1.2–6.1.3).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Edns {
    /// Requestor's UDP payload size (the OPT record's CLASS field).
    pub udp_size: u16,
    /// EDNS version; only 0 is defined.
    pub version: u8,
    /// DNSSEC OK (RFC 3225).
    pub dnssec_ok: bool,
}

/// Why a packet is not a query nodedns can serve.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum ParseError {
    /// Fewer than 12 bytes: there is no ID to answer to. Drop.
    #[error("shorter than a DNS header")]
    ShortHeader,
    /// QR=1: a response, not a query. Never answer it (that is how reflection loops start). Drop.
    #[error("QR bit set: not a query")]
    NotQuery,
    /// An opcode other than QUERY (RFC 1035 §4.1.1). Answer NOTIMP.
    #[error("opcode {0} not implemented")]
    Opcode(u8),
    /// QDCOUNT is not 1, or ANCOUNT/NSCOUNT are not 0 (RFC 1035 §4.1.2; RFC 9619). Answer FORMERR.
    #[error("question count is not 1")]
    QuestionCount,
    /// The question's name is malformed: a compression pointer, a label over 63 bytes, a name
    /// over 255 bytes, an unknown label type, or it runs past the end. Answer FORMERR.
    #[error("malformed question name")]
    BadName,
    /// The packet ends inside the question or the additional section. Answer FORMERR.
    #[error("truncated question or additional section")]
    Truncated,
    /// The additional section is malformed: more than one OPT, an OPT with a non-root name, or a
    /// record that does not fit. Answer FORMERR.
    #[error("malformed additional section")]
    BadAdditional,
    /// Bytes after the last record the header announces. Answer FORMERR.
    #[error("trailing bytes after the message")]
    TrailingBytes,
    /// An OPT record with a version other than 0 (RFC 6891 §6.1.3). Answer BADVERS.
    #[error("EDNS version {0} not supported")]
    BadVersion(u8),
}

impl ParseError {
    /// The RCODE to answer with, or `None` when the packet must be dropped silently.
    pub fn rcode(self) -> Option<u16> {
        let _ = self;
        todo!()
    }
}

impl<'a> Query<'a> {
    /// Parses a query. Accepts exactly one question, no answer or authority records, and in the
    /// additional section at most one OPT (other records, such as a TSIG, are skipped over but must
    /// be well-formed). Never panics, never allocates.
    pub fn parse(bytes: &'a [u8]) -> Result<Self, ParseError> {
        let _ = bytes;
        todo!()
    }

    /// The packet as received.
    pub fn bytes(&self) -> &'a [u8] {
        self.bytes
    }

    pub fn id(&self) -> u16 {
        todo!()
    }

    /// Recursion desired: echoed in the answer.
    pub fn rd(&self) -> bool {
        todo!()
    }

    /// Checking disabled (RFC 4035 §3.2.2): part of the key.
    pub fn cd(&self) -> bool {
        todo!()
    }

    /// The question's name in wire form exactly as sent (case preserved, so the answer can echo
    /// a 0x20-randomized name back).
    pub fn qname(&self) -> &'a [u8] {
        todo!()
    }

    pub fn qtype(&self) -> u16 {
        todo!()
    }

    pub fn qclass(&self) -> u16 {
        todo!()
    }

    /// Bytes from offset 12 to the end of the question (name, type, class).
    pub fn question(&self) -> &'a [u8] {
        todo!()
    }

    /// The client's OPT record, if it sent one.
    pub fn edns(&self) -> Option<Edns> {
        todo!()
    }

    /// The largest UDP answer this client accepts: 512 without EDNS, otherwise its advertised size
    /// clamped to [512, [`crate::EDNS_UDP_SIZE`]].
    pub fn udp_limit(&self) -> usize {
        todo!()
    }

    /// The cache key for this query.
    pub fn key(&self) -> Key {
        todo!()
    }
}
