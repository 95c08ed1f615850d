//! Answers nodedns makes up itself: SERVFAIL, FORMERR, REFUSED, NOTIMP, BADVERS.

use crate::Query;

/// Writes into `out` (cleared first) an answer to `query` with `rcode`: the query's ID, opcode and
/// RD, QR and RA set, the question echoed, no records, and an OPT (advertising
/// [`crate::EDNS_UDP_SIZE`], DO echoed, the extended RCODE bits for BADVERS) only if the query had
/// one.
pub fn write_error(query: &Query<'_>, rcode: u16, out: &mut Vec<u8>) {
    let _ = (query, rcode, out);
    todo!()
}

/// Writes a reply for a packet whose question could not be parsed: the packet's ID, opcode and RD,
/// QR set, `rcode` (FORMERR, NOTIMP or BADVERS), all counts zero. Writes nothing (and returns
/// `false`) if the packet has no full header or is itself a response.
pub fn write_formerr(packet: &[u8], rcode: u16, out: &mut Vec<u8>) -> bool {
    let _ = (packet, rcode, out);
    todo!()
}
