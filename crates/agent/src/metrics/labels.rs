//! The label vocabulary: every label value CoreDNS 1.11 writes, as small fixed sets indexed on
//! the hit path, and the histogram buckets.

use std::borrow::Cow;
use std::net::SocketAddr;

use nodedns_cache::Class;
use nodedns_wire::{rcode, rtype};

/// The `proto` label: the transport a query came over.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Transport {
    Udp = 0,
    Tcp = 1,
}
pub(super) const TRANSPORTS: [Transport; 2] = [Transport::Udp, Transport::Tcp];

impl Transport {
    pub fn as_str(self) -> &'static str {
        match self {
            Transport::Udp => "udp",
            Transport::Tcp => "tcp",
        }
    }
}

/// The `plugin` label CoreDNS 1.11 puts on `coredns_dns_responses_total`: its recorder names
/// the plugin whose response writer wrote last. In a block with `cache` that is the cache's
/// writer for hits and forwarded answers alike, `forward` only in a block without cache, and
/// empty for errors the server itself writes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Plugin {
    /// Written by the server itself (REFUSED, a SERVFAIL nodedns made).
    None = 0,
    Cache = 1,
    Forward = 2,
    /// The plugins after the cache that answer by themselves (`crate::plugin`), in a block
    /// without cache.
    Hosts = 3,
    Whoami = 4,
    Template = 5,
    /// `dns64`'s synthesized AAAA answers (it writes them before the cache, in any block).
    Dns64 = 6,
}
/// Label values of [`Plugin`], by index.
pub(super) const PLUGINS: [&str; 7] = [
    "", "cache", "forward", "hosts", "whoami", "template", "dns64",
];

/// Query types with their own `type` label: CoreDNS 1.11's `monitorType`, by number, in the
/// order of [`qtype_index`]; others are `other`. Their label is their mnemonic as CoreDNS writes
/// it ([`type_label`]).
pub const MONITORED: [u16; 18] = [
    1,   // A
    28,  // AAAA
    5,   // CNAME
    48,  // DNSKEY
    43,  // DS
    15,  // MX
    50,  // NSEC3
    47,  // NSEC
    2,   // NS
    12,  // PTR
    46,  // RRSIG
    6,   // SOA
    33,  // SRV
    16,  // TXT
    65,  // HTTPS
    251, // IXFR
    252, // AXFR
    255, // ANY
];
pub(super) const TYPES: usize = MONITORED.len() + 1;
const OTHER_TYPE: usize = MONITORED.len();

/// Index of `qtype` in [`MONITORED`] (a jump table, not a search: it runs for every query).
#[inline]
pub(super) fn qtype_index(qtype: u16) -> usize {
    match qtype {
        1 => 0,
        28 => 1,
        5 => 2,
        48 => 3,
        43 => 4,
        15 => 5,
        50 => 6,
        47 => 7,
        2 => 8,
        12 => 9,
        46 => 10,
        6 => 11,
        33 => 12,
        16 => 13,
        65 => 14,
        251 => 15,
        252 => 16,
        255 => 17,
        _ => OTHER_TYPE,
    }
}

/// The `type` label of type slot `t` ([`qtype_index`]): the monitored type's mnemonic
/// (`nodedns_wire::rtype::name`, miekg/dns's names), or `other`.
pub(super) fn type_label(t: usize) -> &'static str {
    MONITORED
        .get(t)
        .and_then(|&qtype| rtype::name(qtype))
        .unwrap_or("other")
}

/// RCODE slots: the header's 4 bits (the request path reads no extended RCODE).
pub(super) const RCODES: usize = 16;

/// The `rcode` label of `coredns_dns_responses_total` for a header RCODE, as CoreDNS writes it:
/// its name (`nodedns_wire::rcode::name`, miekg/dns's `RcodeToString`), `RCODE<n>` for a code
/// without one.
pub(super) fn rcode_label(rcode: usize) -> Cow<'static, str> {
    u16::try_from(rcode)
        .ok()
        .and_then(rcode::name)
        .map_or_else(|| Cow::Owned(format!("RCODE{rcode}")), Cow::Borrowed)
}

/// CoreDNS's `type` label of cache hits: it keeps SERVFAIL in its denial cache.
#[inline]
pub(super) fn class_index(class: Class) -> usize {
    match class {
        Class::Success => 0,
        Class::Denial | Class::ServFail => 1,
    }
}
/// Label values of [`class_index`], by index.
pub(super) const CLASSES: [&str; 2] = ["success", "denial"];

/// CoreDNS's `plugin.TimeBuckets`: 0.25 ms doubling to 8.192 s, in nanoseconds.
pub(super) const TIME_BOUNDS_NS: [u64; 16] = {
    let mut b = [0u64; 16];
    let mut i = 0;
    while i < 16 {
        b[i] = 250_000 << i;
        i += 1;
    }
    b
};
pub(super) const TIME_SLOTS: usize = TIME_BOUNDS_NS.len() + 1;

/// CoreDNS's buckets for request and response sizes, in bytes.
pub(super) const SIZE_BOUNDS: [usize; 14] = [
    0, 100, 200, 300, 400, 511, 1023, 2047, 4095, 8291, 16000, 32000, 48000, 64000,
];
pub(super) const SIZE_SLOTS: usize = SIZE_BOUNDS.len() + 1;

#[inline]
pub(super) fn time_bucket(ns: u64) -> usize {
    TIME_BOUNDS_NS
        .iter()
        .position(|&b| ns <= b)
        .unwrap_or(TIME_SLOTS - 1)
}

#[inline]
pub(super) fn size_bucket(len: usize) -> usize {
    // DNS messages are mostly under 400 bytes, where the bounds step by 100.
    if len <= 400 {
        return len.div_ceil(100);
    }
    SIZE_BOUNDS
        .iter()
        .position(|&b| len <= b)
        .unwrap_or(SIZE_SLOTS - 1)
}

/// The `server` label CoreDNS gives a `dns://` listen address.
pub fn server_label(addr: SocketAddr) -> String {
    scheme_label("dns", addr)
}

/// The `server` label CoreDNS gives a listen address of a block of `scheme` (`dns`, `tls`,
/// `https`).
pub fn scheme_label(scheme: &str, addr: SocketAddr) -> String {
    if addr.ip().is_unspecified() {
        format!("{scheme}://:{}", addr.port())
    } else {
        format!("{scheme}://{addr}")
    }
}

/// The `error` label of `nodedns_upstream_failures_total`, by [`upstream_error_kind`], and
/// [`UNUSABLE_REPLY`].
pub const UPSTREAM_ERRORS: [&str; 7] = [
    "overloaded",
    "timeout",
    "unreachable",
    "bad_reply",
    "bad_query",
    "all_down",
    "unusable_reply",
];

/// The index in [`UPSTREAM_ERRORS`] of a reply the upstream pool accepted (the query's ID and
/// question, from the connection that asked) that nodedns cannot serve (it fails
/// `nodedns_wire::Reply::parse`: a misplaced OPT, a record running past the end, ...).
pub const UNUSABLE_REPLY: usize = 6;

/// The index of `err`'s kind in [`UPSTREAM_ERRORS`].
pub fn upstream_error_kind(err: &nodedns_upstream::Error) -> usize {
    match err {
        nodedns_upstream::Error::Overloaded => 0,
        nodedns_upstream::Error::Timeout => 1,
        nodedns_upstream::Error::Unreachable => 2,
        nodedns_upstream::Error::BadReply => 3,
        nodedns_upstream::Error::BadQuery => 4,
        nodedns_upstream::Error::AllDown => 5,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_qtype_jump_table_agrees_with_the_label_list() {
        for (i, &t) in MONITORED.iter().enumerate() {
            assert_eq!(qtype_index(t), i);
        }
        assert_eq!(
            qtype_index(35),
            OTHER_TYPE,
            "NAPTR is not a CoreDNS type label"
        );
    }

    #[test]
    fn type_labels_are_coredns_monitored_types() {
        let labels: Vec<&str> = (0..TYPES).map(type_label).collect();
        assert_eq!(
            labels,
            [
                "A", "AAAA", "CNAME", "DNSKEY", "DS", "MX", "NSEC3", "NSEC", "NS", "PTR", "RRSIG",
                "SOA", "SRV", "TXT", "HTTPS", "IXFR", "AXFR", "ANY", "other"
            ]
        );
    }

    #[test]
    fn rcode_labels_are_coredns_names_or_rcode_n() {
        let labels: Vec<Cow<'_, str>> = (0..RCODES).map(rcode_label).collect();
        assert_eq!(
            labels,
            [
                "NOERROR",
                "FORMERR",
                "SERVFAIL",
                "NXDOMAIN",
                "NOTIMP",
                "REFUSED",
                "YXDOMAIN",
                "YXRRSET",
                "NXRRSET",
                "NOTAUTH",
                "NOTZONE",
                "DSOTYPENI",
                "RCODE12",
                "RCODE13",
                "RCODE14",
                "RCODE15"
            ]
        );
    }

    #[test]
    fn buckets_are_coredns_bounds_inclusive() {
        assert_eq!(time_bucket(0), 0);
        assert_eq!(time_bucket(250_000), 0);
        assert_eq!(time_bucket(250_001), 1);
        assert_eq!(time_bucket(8_192_000_000), 15);
        assert_eq!(time_bucket(8_192_000_001), 16);
        assert_eq!(size_bucket(0), 0);
        assert_eq!(size_bucket(29), 1);
        assert_eq!(size_bucket(511), 5);
        assert_eq!(size_bucket(65_535), 14);
        for len in 0..70_000 {
            let slow = SIZE_BOUNDS
                .iter()
                .position(|&b| len <= b)
                .unwrap_or(SIZE_SLOTS - 1);
            assert_eq!(size_bucket(len), slow, "{len}");
        }
    }

    #[test]
    fn server_labels_are_written_as_coredns_does() {
        assert_eq!(
            server_label("169.254.20.10:53".parse().unwrap()),
            "dns://169.254.20.10:53"
        );
        assert_eq!(server_label("0.0.0.0:53".parse().unwrap()), "dns://:53");
        assert_eq!(
            scheme_label("tls", "169.254.20.10:853".parse().unwrap()),
            "tls://169.254.20.10:853"
        );
        assert_eq!(
            scheme_label("https", "[::]:443".parse().unwrap()),
            "https://:443"
        );
        assert_eq!(server_label("[::]:53".parse().unwrap()), "dns://:53");
        assert_eq!(
            server_label("[fd00::10]:53".parse().unwrap()),
            "dns://[fd00::10]:53"
        );
    }

    #[test]
    fn every_plugin_and_class_has_its_label() {
        assert_eq!(PLUGINS[Plugin::None as usize], "");
        assert_eq!(PLUGINS[Plugin::Cache as usize], "cache");
        assert_eq!(PLUGINS[Plugin::Forward as usize], "forward");
        assert_eq!(PLUGINS[Plugin::Hosts as usize], "hosts");
        assert_eq!(PLUGINS[Plugin::Whoami as usize], "whoami");
        assert_eq!(PLUGINS[Plugin::Template as usize], "template");
        assert_eq!(PLUGINS[Plugin::Dns64 as usize], "dns64");
        assert_eq!(CLASSES[class_index(Class::Success)], "success");
        assert_eq!(CLASSES[class_index(Class::ServFail)], "denial");
    }
}
