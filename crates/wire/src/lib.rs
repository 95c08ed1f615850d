//! DNS bytes, and nothing else.
//!
//! This crate is the bottom of nodedns: every other crate reads and writes DNS messages through
//! it. It never does I/O, never reads a clock and never knows tokio. The cache-hit path goes
//! through [`Query::parse`] and [`Reply::write_answer`] only, so both work on borrowed bytes and a
//! caller-owned output buffer: after warm-up, serving a hit allocates nothing.
//!
//! Map:
//! - [`Header`]: the fixed header of any message (ID, flags, RCODE, counts), and [`set_id`].
//! - [`Query`]: a client query, parsed in place (header, the one question, the OPT record).
//! - [`Key`]: what a cached answer is filed under (lowercased qname, qtype, qclass, DO, CD).
//! - [`build_query`]: the canonical upstream query for a key; [`root_ns_query`]: the health
//!   check's `. IN NS`.
//! - [`Reply`]: an upstream reply, validated once, OPT removed, every TTL field located, ready to
//!   be copied and patched for any later query with the same key.
//! - [`write_error`] / [`write_formerr`]: synthesized SERVFAIL, FORMERR, REFUSED, NOTIMP.
//! - [`frame`]: DNS-over-TCP length framing (RFC 1035 §4.2.2, RFC 7766 §8), the one framer of
//!   both TCP readers (client connections and upstream connections).
//! - [`set_opt_size`], [`rotate_addresses`]: in-place edits of an answer already written
//!   (`bufsize`'s OPT size, `loadbalance`'s round robin).
//! - [`rcode::name`], [`rtype::name`]: the names CoreDNS gives RCODEs and record types.
//!
//! Invariants:
//! - No function here panics on any input; malformed input is an `Err`.
//! - Every offset stored in a [`Reply`] was checked against its bytes when it was indexed.
//! - No name in a stored reply (an owner name, or a name in RDATA of a type whose RDATA names
//!   receivers decompress) is read from bytes that serving rewrites (header, TTL fields), and
//!   the question is replaced only by one equal up to letter case, so every copy
//!   [`Reply::write_answer`] writes is as well-formed as the reply it came from and carries the
//!   same names.

mod edit;
mod header;
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

pub use edit::{answers_of_type, rotate_addresses, set_opt_size};
pub use header::{Header, set_id};
pub use key::{KEY_CAP, Key, build_query, ns_query, root_ns_query};
pub use name::is_subdomain;
pub use query::{Edns, Layout, ParseError, Query};
pub use reply::{Info, Reply, ReplyError, TtlRule, same_question};
pub use synth::{write_error, write_formerr, write_truncated};

/// Length of the fixed DNS header (RFC 1035 §4.1.1).
pub const HEADER_LEN: usize = 12;

/// The largest DNS message: what a TCP length prefix can announce (RFC 1035 §4.2.2).
pub const MAX_MESSAGE_LEN: usize = u16::MAX as usize;

/// Longest name in wire form, including the root label (RFC 1035 §2.3.4).
pub const MAX_NAME_LEN: usize = 255;

/// The UDP payload size nodedns advertises in its own OPT records (DNS flag day 2020: avoids IP
/// fragmentation on any path).
pub const EDNS_UDP_SIZE: u16 = 1232;

/// The largest UDP reply a client without EDNS accepts (RFC 1035 §4.2.1).
pub const MIN_UDP_SIZE: usize = 512;

/// Record types (RFC 1035 §3.2.2 and IANA's registry, RFC 6895 §3.1) and their names.
pub mod rtype {
    pub const A: u16 = 1;
    pub const NS: u16 = 2;
    pub const CNAME: u16 = 5;
    pub const SOA: u16 = 6;
    pub const PTR: u16 = 12;
    pub const HINFO: u16 = 13;
    pub const TXT: u16 = 16;
    pub const AAAA: u16 = 28;
    pub const SRV: u16 = 33;
    pub const OPT: u16 = 41;
    pub const IXFR: u16 = 251;
    pub const AXFR: u16 = 252;
    pub const ANY: u16 = 255;

    /// The mnemonic CoreDNS writes for a record type, in its `type` metric label and its query
    /// log: miekg/dns's `TypeToString` (which names 0 `None` and 65535 `Reserved`). `None` for a
    /// type without one: CoreDNS then writes `TYPE<n>` (RFC 3597 §5).
    pub fn name(rtype: u16) -> Option<&'static str> {
        Some(match rtype {
            0 => "None",
            1 => "A",
            2 => "NS",
            3 => "MD",
            4 => "MF",
            5 => "CNAME",
            6 => "SOA",
            7 => "MB",
            8 => "MG",
            9 => "MR",
            10 => "NULL",
            12 => "PTR",
            13 => "HINFO",
            14 => "MINFO",
            15 => "MX",
            16 => "TXT",
            17 => "RP",
            18 => "AFSDB",
            19 => "X25",
            20 => "ISDN",
            21 => "RT",
            23 => "NSAP-PTR",
            24 => "SIG",
            25 => "KEY",
            26 => "PX",
            27 => "GPOS",
            28 => "AAAA",
            29 => "LOC",
            30 => "NXT",
            31 => "EID",
            32 => "NIMLOC",
            33 => "SRV",
            34 => "ATMA",
            35 => "NAPTR",
            36 => "KX",
            37 => "CERT",
            39 => "DNAME",
            41 => "OPT",
            42 => "APL",
            43 => "DS",
            44 => "SSHFP",
            45 => "IPSECKEY",
            46 => "RRSIG",
            47 => "NSEC",
            48 => "DNSKEY",
            49 => "DHCID",
            50 => "NSEC3",
            51 => "NSEC3PARAM",
            52 => "TLSA",
            53 => "SMIMEA",
            55 => "HIP",
            56 => "NINFO",
            57 => "RKEY",
            58 => "TALINK",
            59 => "CDS",
            60 => "CDNSKEY",
            61 => "OPENPGPKEY",
            62 => "CSYNC",
            63 => "ZONEMD",
            64 => "SVCB",
            65 => "HTTPS",
            99 => "SPF",
            100 => "UINFO",
            101 => "UID",
            102 => "GID",
            103 => "UNSPEC",
            104 => "NID",
            105 => "L32",
            106 => "L64",
            107 => "LP",
            108 => "EUI48",
            109 => "EUI64",
            128 => "NXNAME",
            249 => "TKEY",
            250 => "TSIG",
            251 => "IXFR",
            252 => "AXFR",
            253 => "MAILB",
            254 => "MAILA",
            255 => "ANY",
            256 => "URI",
            257 => "CAA",
            258 => "AVC",
            260 => "AMTRELAY",
            261 => "RESINFO",
            32768 => "TA",
            32769 => "DLV",
            65535 => "Reserved",
            _ => return None,
        })
    }
}

/// Classes (RFC 1035 §3.2.4).
pub mod class {
    pub const IN: u16 = 1;
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

    /// The name CoreDNS writes for an RCODE, in its `rcode` metric labels and its query log:
    /// miekg/dns's `RcodeToString`, so 11 is `DSOTYPENI` (RFC 8490 §10.2) and 16, which is both
    /// BADVERS (RFC 6891 §9) and BADSIG (RFC 8945 §5.2), is `BADSIG`. `None` for a code without
    /// one; CoreDNS then writes `RCODE<n>` in `coredns_dns_responses_total` and the bare number in
    /// `coredns_proxy_*` and the query log.
    pub fn name(rcode: u16) -> Option<&'static str> {
        Some(match rcode {
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
            11 => "DSOTYPENI",
            16 => "BADSIG",
            17 => "BADKEY",
            18 => "BADTIME",
            19 => "BADMODE",
            20 => "BADNAME",
            21 => "BADALG",
            22 => "BADTRUNC",
            23 => "BADCOOKIE",
            _ => return None,
        })
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

#[cfg(test)]
mod tests {
    use hickory_proto::rr::RecordType;

    use super::*;

    #[test]
    fn rcode_names_are_coredns_labels() {
        assert_eq!(rcode::name(0), Some("NOERROR"));
        assert_eq!(rcode::name(3), Some("NXDOMAIN"));
        assert_eq!(rcode::name(11), Some("DSOTYPENI"));
        assert_eq!(rcode::name(rcode::BADVERS), Some("BADSIG"));
        assert_eq!(rcode::name(23), Some("BADCOOKIE"));
        for unnamed in [12, 13, 14, 15, 24, 4095] {
            assert_eq!(rcode::name(unnamed), None, "{unnamed}");
        }
    }

    #[test]
    fn type_names_agree_with_hickory() {
        for rtype in 1..=u16::MAX {
            let Some(ours) = rtype::name(rtype) else {
                continue;
            };
            let theirs = RecordType::from(rtype);
            if !matches!(theirs, RecordType::Unknown(_)) {
                assert_eq!(ours, theirs.to_string(), "{rtype}");
            }
        }
        assert_eq!(rtype::name(rtype::HINFO), Some("HINFO"));
        assert_eq!(rtype::name(65), Some("HTTPS"));
        assert_eq!(rtype::name(23), Some("NSAP-PTR"));
        assert_eq!(rtype::name(11), None, "WKS has no name in CoreDNS");
        assert_eq!(rtype::name(54), None);
    }
}
