//! Answers nodedns makes up itself: SERVFAIL, FORMERR, REFUSED, NOTIMP, BADVERS.

use crate::octets::{get16, header, push_opt, set16};
use crate::query::opcode;
use crate::{HEADER_LEN, Query, flags};

/// Writes into `out` (cleared first) an answer to `query` with `rcode`: the query's ID, opcode and
/// RD, QR set (RA clear, as CoreDNS's own error replies), the question echoed, no records, and an OPT (advertising
/// [`crate::EDNS_UDP_SIZE`], DO echoed, the extended RCODE bits for BADVERS) only if the query had
/// one.
pub fn write_error(query: &Query<'_>, rcode: u16, out: &mut Vec<u8>) {
    out.clear();
    let edns = query.edns();
    let question = query.question();
    out.reserve(HEADER_LEN + question.len() + crate::octets::OPT_LEN);
    let mut header_flags = response_flags(query.opcode(), query.rd(), rcode);
    // RFC 4035 §3.1.6 / RFC 6840 §5.9: CD is copied from the query into the response.
    if query.cd() {
        header_flags |= flags::CD;
    }
    out.extend_from_slice(&[0; HEADER_LEN]);
    set16(out, header::ID, query.id());
    set16(out, header::FLAGS, header_flags);
    set16(out, header::QDCOUNT, 1);
    out.extend_from_slice(question);
    if let Some(edns) = edns {
        // RFC 6891 §6.1.3: the upper 8 bits of a 12-bit RCODE travel in the OPT.
        push_opt(out, (rcode >> 4) as u8, edns.dnssec_ok);
        set16(out, header::ARCOUNT, 1);
    }
}

/// Writes into `out` (cleared first) an empty answer to `query` with TC set: NOERROR, the
/// question echoed, no records (and an OPT if the query had one), as [`write_error`] writes
/// them. "Ask again over TCP" (RFC 7766 §5): what a UDP client beyond its rate limit gets.
pub fn write_truncated(query: &Query<'_>, out: &mut Vec<u8>) {
    write_error(query, u16::from(crate::rcode::NOERROR), out);
    let header_flags = get16(out, header::FLAGS).unwrap_or(0);
    set16(out, header::FLAGS, header_flags | flags::TC);
}

/// Writes a reply for a packet whose question could not be parsed: the packet's ID, opcode and RD,
/// QR set, `rcode` (FORMERR, NOTIMP or BADVERS), all counts zero except, for an extended
/// RCODE such as BADVERS, ARCOUNT 1 for the OPT record that carries its upper bits (RFC 6891
/// §6.1.3: without it a BADVERS would read as NOERROR). Writes nothing (and returns `false`) if
/// the packet has no full header or is itself a response.
pub fn write_formerr(packet: &[u8], rcode: u16, out: &mut Vec<u8>) -> bool {
    out.clear();
    let (Some(id), Some(packet_flags)) = (get16(packet, header::ID), get16(packet, header::FLAGS))
    else {
        return false;
    };
    if packet.len() < HEADER_LEN || packet_flags & flags::QR != 0 {
        return false;
    }
    out.extend_from_slice(&[0; HEADER_LEN]);
    set16(out, header::ID, id);
    let rd = packet_flags & flags::RD != 0;
    set16(
        out,
        header::FLAGS,
        response_flags(opcode(packet_flags), rd, rcode),
    );
    if rcode > 0xF {
        push_opt(out, (rcode >> 4) as u8, false);
        set16(out, header::ARCOUNT, 1);
    }
    true
}

/// QR, the opcode, RD and the low 4 bits of `rcode` (RFC 1035 §4.1.1). RA stays clear, as in
/// the replies CoreDNS (node-cache) makes itself (`dns.Msg.SetRcode`): a client sees the same
/// flags from nodedns and from node-cache when the upstream fails or a name has no block.
fn response_flags(opcode: u8, rd: bool, rcode: u16) -> u16 {
    let mut bits = flags::QR | (u16::from(opcode) << 11 & flags::OPCODE_MASK);
    if rd {
        bits |= flags::RD;
    }
    bits | (rcode & flags::RCODE_MASK)
}

#[cfg(test)]
mod tests {
    use hickory_proto::op::{MessageType, OpCode, ResponseCode};
    use hickory_proto::rr::RecordType;

    use super::*;
    use crate::testutil::{decode, encode, query_message};
    use crate::{ParseError, rcode};

    #[test]
    fn servfail_echoes_id_rd_question_and_sets_qr_not_ra() {
        let mut msg = query_message(0x7777, "ExAmple.com.", RecordType::A, None);
        msg.metadata.checking_disabled = true;
        let bytes = encode(&msg);
        let query = Query::parse(&bytes).unwrap();
        let mut out = vec![1, 2, 3];
        write_error(&query, rcode::SERVFAIL.into(), &mut out);
        let reply = decode(&out);
        assert_eq!(reply.metadata.id, 0x7777);
        assert_eq!(reply.metadata.message_type, MessageType::Response);
        assert_eq!(reply.metadata.op_code, OpCode::Query);
        assert!(reply.metadata.recursion_desired);
        assert!(!reply.metadata.recursion_available);
        assert!(reply.metadata.checking_disabled);
        assert!(!reply.metadata.authoritative);
        assert_eq!(reply.metadata.response_code, ResponseCode::ServFail);
        assert_eq!(reply.queries, msg.queries);
        assert_eq!(
            &out[HEADER_LEN..],
            query.question(),
            "question bytes echoed as sent"
        );
        assert!(reply.edns.is_none());
    }

    #[test]
    fn truncated_is_an_empty_noerror_answer_with_tc() {
        for edns in [None, Some((1232, false))] {
            let msg = query_message(0x0102, "Flood.example.", RecordType::AAAA, edns);
            let bytes = encode(&msg);
            let query = Query::parse(&bytes).unwrap();
            let mut out = Vec::new();
            write_truncated(&query, &mut out);
            let reply = decode(&out);
            assert_eq!(reply.metadata.id, 0x0102);
            assert!(reply.metadata.truncation);
            assert_eq!(reply.metadata.response_code, ResponseCode::NoError);
            assert_eq!(reply.queries, msg.queries);
            assert!(reply.answers.is_empty() && reply.authorities.is_empty());
            assert_eq!(reply.edns.is_some(), edns.is_some());
        }
    }

    #[test]
    fn refused_with_edns_gets_our_opt_with_do_echoed() {
        let bytes = encode(&query_message(
            1,
            "example.com.",
            RecordType::A,
            Some((4096, true)),
        ));
        let query = Query::parse(&bytes).unwrap();
        let mut out = Vec::new();
        write_error(&query, rcode::REFUSED.into(), &mut out);
        let reply = decode(&out);
        assert_eq!(reply.metadata.response_code, ResponseCode::Refused);
        let opt = reply.edns.unwrap();
        assert_eq!(opt.max_payload(), crate::EDNS_UDP_SIZE);
        assert!(opt.flags().dnssec_ok);
        assert_eq!(opt.rcode_high(), 0);
    }

    #[test]
    fn extended_rcode_goes_into_the_opt() {
        let bytes = encode(&query_message(
            1,
            "example.com.",
            RecordType::A,
            Some((1232, false)),
        ));
        let query = Query::parse(&bytes).unwrap();
        let mut out = Vec::new();
        write_error(&query, rcode::BADVERS, &mut out);
        assert_eq!(out[3] & 0x0F, 0);
        assert_eq!(decode(&out).edns.unwrap().rcode_high(), 1);
    }

    #[test]
    fn formerr_for_an_unparsable_query_has_no_records() {
        let mut bytes = encode(&query_message(0x0102, "example.com.", RecordType::A, None));
        bytes[5] = 2; // QDCOUNT 2, only one question present.
        let err = Query::parse(&bytes).unwrap_err();
        let mut out = Vec::new();
        assert!(write_formerr(&bytes, err.rcode().unwrap(), &mut out));
        assert_eq!(out.len(), HEADER_LEN);
        let reply = decode(&out);
        assert_eq!(reply.metadata.id, 0x0102);
        assert_eq!(reply.metadata.message_type, MessageType::Response);
        assert!(reply.metadata.recursion_desired);
        assert_eq!(reply.metadata.response_code, ResponseCode::FormErr);
        assert!(reply.queries.is_empty());
    }

    #[test]
    fn notimp_echoes_the_opcode() {
        let mut msg = query_message(3, "example.com.", RecordType::SOA, None);
        msg.metadata.op_code = OpCode::Notify;
        msg.metadata.recursion_desired = false;
        let bytes = encode(&msg);
        let err = Query::parse(&bytes).unwrap_err();
        let mut out = Vec::new();
        assert!(write_formerr(&bytes, err.rcode().unwrap(), &mut out));
        let reply = decode(&out);
        assert_eq!(reply.metadata.op_code, OpCode::Notify);
        assert!(!reply.metadata.recursion_desired);
        assert_eq!(reply.metadata.response_code, ResponseCode::NotImp);
    }

    #[test]
    fn badvers_carries_its_upper_bits_in_an_opt() {
        let mut bytes = encode(&query_message(
            4,
            "example.com.",
            RecordType::A,
            Some((1232, true)),
        ));
        let version_at = bytes.len() - 11 + 6;
        bytes[version_at] = 1;
        let err = Query::parse(&bytes).unwrap_err();
        assert_eq!(err, ParseError::BadVersion(1));
        let mut out = Vec::new();
        assert!(write_formerr(&bytes, err.rcode().unwrap(), &mut out));
        let reply = decode(&out);
        assert_eq!(u16::from(reply.metadata.response_code), rcode::BADVERS);
        let opt = reply.edns.unwrap();
        assert_eq!(opt.version(), 0);
        assert_eq!(opt.max_payload(), crate::EDNS_UDP_SIZE);
    }

    #[test]
    fn nothing_written_for_short_packets_or_responses() {
        let mut out = vec![9];
        assert!(!write_formerr(&[0; 11], rcode::FORMERR.into(), &mut out));
        assert!(out.is_empty());
        let mut response = vec![0; 12];
        response[2] = 0x80;
        assert!(!write_formerr(&response, rcode::FORMERR.into(), &mut out));
        assert!(out.is_empty());
    }
}
