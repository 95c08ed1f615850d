//! Test helpers: messages built with hickory-proto, the oracle for the hand-written wire code.

use hickory_proto::op::{Edns as HickoryEdns, Message, MessageType, OpCode, Query as Question};
use hickory_proto::rr::{Name, RecordType};

pub(crate) fn name(text: &str) -> Name {
    Name::from_ascii(text).expect("valid test name")
}

/// A query for `qname`/`qtype` with RD set and, if `edns` is `Some((udp_size, dnssec_ok))`, an
/// OPT record.
pub(crate) fn query_message(
    id: u16,
    qname: &str,
    qtype: RecordType,
    edns: Option<(u16, bool)>,
) -> Message {
    let mut msg = Message::new(id, MessageType::Query, OpCode::Query);
    msg.metadata.recursion_desired = true;
    msg.add_query(Question::query(name(qname), qtype));
    if let Some((size, dnssec_ok)) = edns {
        msg.set_edns(self::edns(size, dnssec_ok));
    }
    msg
}

pub(crate) fn encode(msg: &Message) -> Vec<u8> {
    msg.to_vec().expect("hickory encodes the test message")
}

pub(crate) fn decode(bytes: &[u8]) -> Message {
    Message::from_vec(bytes).expect("hickory decodes our output")
}

/// A response to `query` (same ID and question), RD and RA set, no records yet.
pub(crate) fn response_to(query: &Message) -> Message {
    let mut msg = Message::new(query.metadata.id, MessageType::Response, OpCode::Query);
    msg.metadata.recursion_desired = query.metadata.recursion_desired;
    msg.metadata.recursion_available = true;
    msg.add_queries(query.queries.iter().cloned());
    msg
}

/// An OPT advertising `size`, with DO.
pub(crate) fn edns(size: u16, dnssec_ok: bool) -> HickoryEdns {
    let mut opt = HickoryEdns::new();
    opt.set_max_payload(size);
    opt.set_dnssec_ok(dnssec_ok);
    opt
}
