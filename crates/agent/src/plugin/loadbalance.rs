//! `loadbalance`: round robin of A, AAAA and MX records, as CoreDNS's `plugin/loadbalance`
//! does, so that clients taking the first address spread over all of them.
//!
//! - Configuration ([`parse`]): `loadbalance [round_robin]` (CoreDNS 1.10's one policy; 1.11's
//!   `weighted` and 1.13's `prefer` are refused with a clear error).
//! - Logic ([`Loadbalance::served`]): in every NOERROR answer (not AXFR, IXFR), in each section,
//!   the A records of one owner, and the AAAA records of one owner, are rotated in the bytes
//!   already written for the client (their addresses change places: nothing is re-encoded);
//!   MX records, whose RDATA holds a name other records may point into, are rotated by
//!   decoding and re-encoding the answer, only for MX and ANY queries. The rotation is the
//!   query's ID modulo the number of records: successive queries start with different records.
//! - Place in the chain: before the cache (`plugin::Before`): hits are rotated too, the cached
//!   entry is not.
//! - No metrics (CoreDNS's has none).

use hickory_proto::op::Message;
use hickory_proto::rr::{Record, RecordType};
use nodedns_wire::{Query, rtype};

use crate::config::corefile::Directive;
use crate::config::directives::Out;

/// A `loadbalance` directive (round robin, its one policy).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Loadbalance;

/// Reads a `loadbalance` directive.
pub(crate) fn parse(d: &Directive, out: &mut Out<'_>) -> Option<Loadbalance> {
    out.no_block(d, "loadbalance");
    if !out.arity(d, "loadbalance", 0, 1, "loadbalance [round_robin]") {
        return None;
    }
    match d.args.first().map(|w| (w.text.as_str(), w.line)) {
        None | Some(("round_robin", _)) => Some(Loadbalance),
        Some((policy, line)) => {
            out.err(
                line,
                format!(
                    "loadbalance: unknown policy `{policy}` (nodedns implements `round_robin`, \
                     CoreDNS 1.10's one policy)"
                ),
            );
            None
        }
    }
}

/// The MX query type (RFC 1035 §3.2.2).
const MX: u16 = 15;

impl Loadbalance {
    /// Rotates the answer in `out` to `query`.
    pub fn served(&self, query: &Query<'_>, out: &mut Vec<u8>) {
        if matches!(query.qtype(), rtype::AXFR | rtype::IXFR) {
            return;
        }
        let shift = usize::from(query.id());
        nodedns_wire::rotate_addresses(out, shift);
        if matches!(query.qtype(), MX | rtype::ANY) {
            rotate_mx(out, shift);
        }
    }
}

/// Rotates the MX records of each section of the NOERROR reply in `out` by `shift`, re-encoding
/// it; leaves it as it is when it does not decode or would grow.
fn rotate_mx(out: &mut Vec<u8>, shift: usize) {
    let Ok(mut message) = Message::from_vec(out) else {
        return;
    };
    if message.metadata.response_code != hickory_proto::op::ResponseCode::NoError {
        return;
    }
    let mut changed = false;
    for section in [
        &mut message.answers,
        &mut message.authorities,
        &mut message.additionals,
    ] {
        changed |= rotate_of_type(section, RecordType::MX, shift);
    }
    if !changed {
        return;
    }
    if let Ok(bytes) = message.to_vec()
        && bytes.len() <= out.len()
    {
        *out = bytes;
    }
}

/// Rotates the records of type `rtype` among their places in `records`; true if it moved any.
fn rotate_of_type(records: &mut [Record], rtype: RecordType, shift: usize) -> bool {
    let places: Vec<usize> = (0..records.len())
        .filter(|&i| records[i].record_type() == rtype)
        .collect();
    let n = places.len();
    if n < 2 || shift % n == 0 {
        return false;
    }
    let moved: Vec<Record> = (0..n)
        .map(|i| records[places[(i + shift) % n]].clone())
        .collect();
    for (place, record) in places.into_iter().zip(moved) {
        records[place] = record;
    }
    true
}

#[cfg(test)]
mod tests {
    use std::net::Ipv4Addr;
    use std::str::FromStr;

    use hickory_proto::op::{Message, MessageType, Query as Question, ResponseCode};
    use hickory_proto::rr::rdata::{A, MX as Mx};
    use hickory_proto::rr::{Name, RData};

    use super::*;
    use crate::plugin::testing::load;

    fn loadbalance(line: &str) -> Result<Option<Loadbalance>, Vec<String>> {
        load(line).map(|config| config.servers[0].chain.before.loadbalance)
    }

    #[test]
    fn round_robin_is_the_one_policy() {
        assert_eq!(loadbalance("loadbalance"), Ok(Some(Loadbalance)));
        assert_eq!(
            loadbalance("loadbalance round_robin"),
            Ok(Some(Loadbalance))
        );
        for bad in ["loadbalance weighted /etc/w", "loadbalance random"] {
            let problems = loadbalance(bad).unwrap_err();
            assert_eq!(problems.len(), 1, "{bad}: {problems:?}");
        }
        assert_eq!(loadbalance("log").unwrap(), None);
    }

    /// A query `name` `qtype` with ID `id`, and a NOERROR reply to it holding `answers`.
    fn exchange(id: u16, qtype: RecordType, answers: Vec<Record>) -> (Vec<u8>, Vec<u8>) {
        let name = Name::from_str("mail.example.").unwrap();
        let mut query = Message::query();
        query.metadata.id = id;
        query.add_query(Question::query(name, qtype));
        let mut reply = query.clone();
        reply.metadata.message_type = MessageType::Response;
        reply.metadata.response_code = ResponseCode::NoError;
        reply.answers = answers;
        (query.to_vec().unwrap(), reply.to_vec().unwrap())
    }

    fn rdata(reply: &[u8]) -> Vec<RData> {
        Message::from_vec(reply)
            .unwrap()
            .answers
            .into_iter()
            .map(|r| r.data)
            .collect()
    }

    fn record(data: RData) -> Record {
        Record::from_rdata(Name::from_str("mail.example.").unwrap(), 30, data)
    }

    #[test]
    fn successive_ids_put_each_address_first_and_keep_the_set() {
        let ips: Vec<RData> = (1..=3)
            .map(|i| RData::A(A(Ipv4Addr::new(10, 0, 0, i))))
            .collect();
        let mut firsts = Vec::new();
        for id in 0..3 {
            let (query, mut reply) =
                exchange(id, RecordType::A, ips.iter().cloned().map(record).collect());
            Loadbalance.served(&Query::parse(&query).unwrap(), &mut reply);
            let mut got = rdata(&reply);
            firsts.push(got[0].clone());
            got.sort_by_key(|d| d.to_string());
            assert_eq!(got, ips);
        }
        firsts.sort_by_key(|d| d.to_string());
        firsts.dedup();
        assert_eq!(firsts.len(), 3);
    }

    #[test]
    fn mx_records_rotate_for_an_mx_query() {
        let exchangers: Vec<RData> = ["a.example.", "bb.example."]
            .into_iter()
            .map(|n| RData::MX(Mx::new(10, Name::from_str(n).unwrap())))
            .collect();
        let (query, mut reply) = exchange(
            1,
            RecordType::MX,
            exchangers.iter().cloned().map(record).collect(),
        );
        Loadbalance.served(&Query::parse(&query).unwrap(), &mut reply);
        let got = rdata(&reply);
        assert_eq!(got, [exchangers[1].clone(), exchangers[0].clone()]);
    }
}
