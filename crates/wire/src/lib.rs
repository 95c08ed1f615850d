// NOTE TO THE ENGINEER IMPLEMENTING THIS CRATE: your full brief (priorities, tests, fuzzing, and the
// rules for sharing this checkout with other engineers: commit only crates/wire with `git add crates/wire`,
// never `git add -A`) is in /tmp/prompts/wire.md. Read it now, then delete these three lines.
//! DNS bytes, and nothing else.
//!
//! This crate is the bottom of nodedns: every other crate reads and writes DNS messages through
//! it. It never does I/O, never reads a clock and never knows tokio. The cache-hit path goes
//! through [`Query::parse`] and [`Reply::write_answer`] only, so both work on borrowed bytes and a
//! caller-owned output buffer: after warm-up, serving a hit allocates nothing.
//!
//! Map:
//! - [`Query`]: a client query, parsed in place (header, the one question, the OPT record).
//! - [`Key`]: what a cached answer is filed under (lowercased qname, qtype, qclass, DO, CD).
//! - [`build_query`]: the canonical upstream query for a key.
//! - [`Reply`]: an upstream reply, validated once, OPT removed, every TTL field located, ready to
//!   be copied and patched for any later query with the same key.
//! - [`write_error`] / [`write_formerr`]: synthesized SERVFAIL, FORMERR, REFUSED, NOTIMP.
//! - [`frame`]: DNS-over-TCP length framing (RFC 1035 §4.2.2, RFC 7766 §8).
//!
//! Invariants:
//! - No function here panics on any input; malformed input is an `Err`.
//! - Every offset stored in a [`Reply`] was checked against its bytes when it was indexed.
//! - No name in a stored reply is read from bytes that serving rewrites (header, TTL fields), and
//!   the question is replaced only by one equal up to letter case, so every copy
//!   [`Reply::write_answer`] writes is as well-formed as the reply it came from.

mod key;
mod name;
mod octets;
mod query;
mod reply;
mod synth;

#[cfg(test)]
mod oracle;
#[cfg(test)]
mod testutil;

pub mod frame;

pub use key::{KEY_CAP, Key, build_query};
pub use query::{Edns, ParseError, Query};
pub use reply::{Info, Reply, ReplyError, TtlRule, same_question};
pub use synth::{write_error, write_formerr};

/// Length of the fixed DNS header (RFC 1035 §4.1.1).
pub const HEADER_LEN: usize = 12;

/// Longest name in wire form, including the root label (RFC 1035 §2.3.4).
pub const MAX_NAME_LEN: usize = 255;

/// The UDP payload size nodedns advertises in its own OPT records (DNS flag day 2020: avoids IP
/// fragmentation on any path).
pub const EDNS_UDP_SIZE: u16 = 1232;

/// The largest UDP reply a client without EDNS accepts (RFC 1035 §4.2.1).
pub const MIN_UDP_SIZE: usize = 512;

/// Record types this crate needs to name.
pub mod rtype {
    pub const A: u16 = 1;
    pub const NS: u16 = 2;
    pub const CNAME: u16 = 5;
    pub const SOA: u16 = 6;
    pub const PTR: u16 = 12;
    pub const TXT: u16 = 16;
    pub const AAAA: u16 = 28;
    pub const SRV: u16 = 33;
    pub const OPT: u16 = 41;
    pub const IXFR: u16 = 251;
    pub const AXFR: u16 = 252;
    pub const ANY: u16 = 255;
}

/// Response codes (RFC 1035 §4.1.1, RFC 6891 §6.1.3 for BADVERS).
pub mod rcode {
    pub const NOERROR: u8 = 0;
    pub const FORMERR: u8 = 1;
    pub const SERVFAIL: u8 = 2;
    pub const NXDOMAIN: u8 = 3;
    pub const NOTIMP: u8 = 4;
    pub const REFUSED: u8 = 5;
    /// Extended RCODE 16: the upper 8 bits (1) go in the OPT TTL, the lower 4 (0) in the header.
    pub const BADVERS: u16 = 16;

    /// The name CoreDNS's metrics use for an RCODE (`rcode` label).
    pub fn name(rcode: u16) -> &'static str {
        match rcode {
            0 => "NOERROR",
            1 => "FORMERR",
            2 => "SERVFAIL",
            3 => "NXDOMAIN",
            4 => "NOTIMP",
            5 => "REFUSED",
            6 => "YXDOMAIN",
            7 => "YXRRSET",
            8 => "NXRRSET",
            9 => "NOTAUTH",
            10 => "NOTZONE",
            16 => "BADVERS",
            _ => "OTHER",
        }
    }
}

/// Header flag bits, in the 16-bit flags word at offset 2 (RFC 1035 §4.1.1, RFC 4035 §3.2).
pub mod flags {
    pub const QR: u16 = 0x8000;
    pub const AA: u16 = 0x0400;
    pub const TC: u16 = 0x0200;
    pub const RD: u16 = 0x0100;
    pub const RA: u16 = 0x0080;
    pub const AD: u16 = 0x0020;
    pub const CD: u16 = 0x0010;
    pub const OPCODE_MASK: u16 = 0x7800;
    pub const RCODE_MASK: u16 = 0x000f;
}
