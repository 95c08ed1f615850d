//! `bufsize`: lowers the EDNS UDP payload size of queries, as CoreDNS's `plugin/bufsize` does
//! (to keep answers below the path's MTU: no IP fragmentation).
//!
//! - Configuration ([`parse`]): `bufsize [SIZE]`, SIZE from 512 to 4096 (RFC 6891 §6.2.5);
//!   without SIZE, 512, CoreDNS 1.10's default (node-cache 1.23); CoreDNS 1.11 and later, in
//!   node-cache 1.24 and later, default to 1232.
//! - Logic ([`Bufsize`]): a query whose OPT advertises more than SIZE is served as if it
//!   advertised SIZE: its UDP answer is cut to SIZE, the answer's OPT advertises SIZE, and the
//!   query the block sends upstream advertises at most SIZE. Queries without OPT are left alone.
//! - Place in the chain: before the cache (`plugin::Before`), so hits too.
//! - No metrics (CoreDNS's has none).

use nodedns_wire::Query;

use crate::config::corefile::Directive;
use crate::config::directives::Out;

/// CoreDNS 1.10's size when `bufsize` has no argument.
pub const DEFAULT: u16 = 512;

/// A `bufsize` directive: the largest EDNS UDP payload size a query keeps.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Bufsize {
    pub size: u16,
}

/// Reads a `bufsize` directive.
pub(crate) fn parse(d: &Directive, out: &mut Out<'_>) -> Option<Bufsize> {
    out.no_block(d, "bufsize");
    if !out.arity(d, "bufsize", 0, 1, "bufsize [SIZE]") {
        return None;
    }
    let Some(word) = d.args.first() else {
        return Some(Bufsize { size: DEFAULT });
    };
    match word.text.parse::<u16>() {
        Ok(size) if (512..=4096).contains(&size) => Some(Bufsize { size }),
        _ => {
            out.err(
                word.line,
                format!(
                    "bufsize: `{}` is not a size from 512 to 4096 (RFC 6891)",
                    word.text
                ),
            );
            None
        }
    }
}

impl Bufsize {
    /// Whether `query` advertises more than the size: CoreDNS lowers it then, and only then.
    fn lowers(&self, query: &Query<'_>) -> bool {
        query.edns().is_some_and(|edns| edns.udp_size > self.size)
    }

    /// The largest UDP answer for `query`, given the `limit` it advertises.
    pub fn limit(&self, query: &Query<'_>, limit: usize) -> usize {
        if self.lowers(query) {
            limit.min(usize::from(self.size))
        } else {
            limit
        }
    }

    /// The answer in `out` to `query`: its OPT advertises the size when the query's was lowered.
    pub fn served(&self, query: &Query<'_>, out: &mut [u8]) {
        if self.lowers(query) {
            nodedns_wire::set_opt_size(out, self.size);
        }
    }

    /// The upstream query in `out` (which advertises nodedns's own size): at most the size.
    pub fn upstream(&self, out: &mut [u8]) {
        if self.size < nodedns_wire::EDNS_UDP_SIZE {
            nodedns_wire::set_opt_size(out, self.size);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::plugin::testing::load;

    /// `www.example. A`, with an OPT advertising `size` when given.
    fn query(size: Option<u16>) -> Vec<u8> {
        let mut q = vec![0, 1, 1, 0, 0, 1, 0, 0, 0, 0, 0, u8::from(size.is_some())];
        q.extend_from_slice(b"\x03www\x07example\x00\x00\x01\x00\x01");
        if let Some(size) = size {
            q.extend_from_slice(&[0, 0, 41]);
            q.extend_from_slice(&size.to_be_bytes());
            q.extend_from_slice(&[0, 0, 0, 0, 0, 0]);
        }
        q
    }

    fn bufsize(line: &str) -> Result<Option<Bufsize>, Vec<String>> {
        load(line).map(|config| config.servers[0].chain.before.bufsize)
    }

    #[test]
    fn a_bare_bufsize_is_coredns_1_10s_512_and_sizes_outside_rfc_6891_are_refused() {
        assert_eq!(bufsize("bufsize"), Ok(Some(Bufsize { size: 512 })));
        assert_eq!(bufsize("bufsize 1232"), Ok(Some(Bufsize { size: 1232 })));
        for bad in [
            "bufsize 511",
            "bufsize 4097",
            "bufsize big",
            "bufsize 512 1024",
        ] {
            let problems = bufsize(bad).unwrap_err();
            assert_eq!(problems.len(), 1, "{bad}: {problems:?}");
            assert!(problems[0].contains("bufsize"), "{problems:?}");
        }
    }

    #[test]
    fn a_larger_edns_size_is_lowered_and_the_answer_advertises_the_size() {
        let b = Bufsize { size: 512 };
        let bytes = query(Some(1232));
        let q = Query::parse(&bytes).unwrap();
        assert_eq!(b.limit(&q, q.udp_limit()), 512);
        let mut answer = bytes.clone();
        answer[2] |= 0x80;
        b.served(&q, &mut answer);
        assert_eq!(Query::parse(&bytes).unwrap().edns().unwrap().udp_size, 1232);
        assert_eq!(
            &answer[answer.len() - 8..answer.len() - 6],
            &512u16.to_be_bytes()
        );
    }

    #[test]
    fn queries_without_opt_or_with_a_smaller_size_are_left_alone() {
        let b = Bufsize { size: 1024 };
        for size in [None, Some(600)] {
            let bytes = query(size);
            let q = Query::parse(&bytes).unwrap();
            assert_eq!(b.limit(&q, q.udp_limit()), q.udp_limit());
            let mut answer = bytes.clone();
            b.served(&q, &mut answer);
            assert_eq!(answer, bytes);
        }
    }

    #[test]
    fn the_upstream_query_advertises_at_most_the_size() {
        let mut out = Vec::new();
        let key = Query::parse(&query(None)).unwrap().key();
        nodedns_wire::build_query(key.as_bytes(), 0, &mut out).unwrap();
        Bufsize { size: 512 }.upstream(&mut out);
        assert_eq!(Query::parse(&out).unwrap().edns().unwrap().udp_size, 512);
        Bufsize { size: 4096 }.upstream(&mut out);
        assert_eq!(Query::parse(&out).unwrap().edns().unwrap().udp_size, 512);
    }
}
