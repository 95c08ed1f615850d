//! Client queries, parsed in place.

use crate::key::{self, Key};
use crate::name::{self, NameError};
use crate::octets::{get16, get32, header};
use crate::{HEADER_LEN, MIN_UDP_SIZE, flags, rcode, rtype};

/// A client query: the raw bytes, with the header read and the question and OPT record located.
/// Parsing allocates nothing; every accessor reads the borrowed bytes.
#[derive(Debug, Clone, Copy)]
pub struct Query<'a> {
    bytes: &'a [u8],
    /// Offset just past the question's QCLASS; the question is `bytes[12..question_end]`.
    question_end: u16,
    /// Offset of the OPT record's TYPE field (its owner name is the one byte before), if any.
    opt: Option<u16>,
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
    /// QDCOUNT is not 1, ANCOUNT is not 0, or NSCOUNT is not 0 outside an IXFR (RFC 1035
    /// §4.1.2; RFC 9619; RFC 1995 §3 puts the client's SOA there). Answer FORMERR.
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
        match self {
            ParseError::ShortHeader | ParseError::NotQuery => None,
            ParseError::Opcode(_) => Some(rcode::NOTIMP.into()),
            ParseError::QuestionCount
            | ParseError::BadName
            | ParseError::Truncated
            | ParseError::BadAdditional
            | ParseError::TrailingBytes => Some(rcode::FORMERR.into()),
            ParseError::BadVersion(_) => Some(rcode::BADVERS),
        }
    }
}

/// Where [`Query::parse`] found a query's question end and its OPT record: kept beside the
/// query's bytes, it views them again ([`Query::with_layout`]) without a second parse.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Layout {
    question_end: u16,
    opt: Option<u16>,
}

/// Bytes of a record after its owner name: TYPE, CLASS, TTL, RDLENGTH (RFC 1035 §4.1.3).
pub(crate) const RR_FIXED_LEN: usize = 10;

impl<'a> Query<'a> {
    /// Parses a query. Accepts exactly one question, no answer records, no authority records
    /// except for an IXFR (the SOA of the version the client holds, RFC 1995 §3: skipped over,
    /// and must be well-formed), and in the additional section at most one OPT (other records,
    /// such as a TSIG, are skipped over but must be well-formed). Never panics, never allocates.
    pub fn parse(bytes: &'a [u8]) -> Result<Self, ParseError> {
        // RFC 1035 §4.1.1: the header is 12 bytes; without it there is no ID to answer to.
        let (Some(flags), Some(qdcount), Some(ancount), Some(nscount), Some(arcount)) = (
            get16(bytes, header::FLAGS),
            get16(bytes, header::QDCOUNT),
            get16(bytes, header::ANCOUNT),
            get16(bytes, header::NSCOUNT),
            get16(bytes, header::ARCOUNT),
        ) else {
            return Err(ParseError::ShortHeader);
        };
        if flags & flags::QR != 0 {
            return Err(ParseError::NotQuery);
        }
        let opcode = opcode(flags);
        if opcode != 0 {
            return Err(ParseError::Opcode(opcode));
        }
        // RFC 9619: a QUERY carries exactly one question; a query has no answer, and no
        // authority but an IXFR's SOA.
        if qdcount != 1 || ancount != 0 {
            return Err(ParseError::QuestionCount);
        }
        let name_end =
            name::skip_uncompressed(bytes, HEADER_LEN).map_err(|_| ParseError::BadName)?;
        let question_end = name_end + 4;
        if question_end > bytes.len() {
            return Err(ParseError::Truncated);
        }
        if nscount != 0 && get16(bytes, name_end) != Some(rtype::IXFR) {
            return Err(ParseError::QuestionCount);
        }

        // The authority section (an IXFR's) and the additional section: at most one OPT, in the
        // additional section (RFC 6891 §6.1.1: more than one is FORMERR); anything else (the
        // IXFR's SOA, a TSIG, a client's stray records) only has to be well-formed.
        let mut pos = question_end;
        let mut opt = None;
        for index in 0..u32::from(nscount) + u32::from(arcount) {
            let fixed = name::skip(bytes, pos).map_err(|e| match e {
                NameError::Truncated => ParseError::Truncated,
                NameError::Malformed => ParseError::BadAdditional,
            })?;
            let (Some(rr_type), Some(rdlen)) = (get16(bytes, fixed), get16(bytes, fixed + 8))
            else {
                return Err(ParseError::Truncated);
            };
            let rdata = fixed + RR_FIXED_LEN;
            let end = rdata + usize::from(rdlen);
            if end > bytes.len() {
                return Err(ParseError::Truncated);
            }
            if rr_type == rtype::OPT {
                // RFC 6891 §6.1.2: the OPT's owner name MUST be the root, i.e. one zero byte.
                let authority = index < u32::from(nscount);
                if authority || opt.is_some() || fixed != pos + 1 || bytes.get(pos) != Some(&0) {
                    return Err(ParseError::BadAdditional);
                }
                if !options_well_formed(bytes.get(rdata..end).unwrap_or_default()) {
                    return Err(ParseError::BadAdditional);
                }
                opt = Some(u16::try_from(fixed).map_err(|_| ParseError::BadAdditional)?);
            }
            pos = end;
        }
        if pos != bytes.len() {
            return Err(ParseError::TrailingBytes);
        }

        let query = Query {
            bytes,
            // question_end ≤ bytes.len(), and a name is at most 255 bytes: it fits.
            question_end: u16::try_from(question_end).map_err(|_| ParseError::Truncated)?,
            opt,
        };
        // RFC 6891 §6.1.3: a responder that does not implement the requested version answers
        // BADVERS. Checked last, so a malformed packet gets FORMERR first.
        if let Some(edns) = query.edns()
            && edns.version != 0
        {
            return Err(ParseError::BadVersion(edns.version));
        }
        Ok(query)
    }

    /// What parsing found, to view the same bytes again later ([`Query::with_layout`]).
    pub fn layout(&self) -> Layout {
        Layout {
            question_end: self.question_end,
            opt: self.opt,
        }
    }

    /// `bytes`, which [`Query::parse`] accepted with `layout`, viewed as that query again without
    /// parsing them. Other bytes give a query whose accessors read the wrong places (they read
    /// in bounds all the same: never a panic).
    pub fn with_layout(bytes: &'a [u8], layout: Layout) -> Self {
        debug_assert_eq!(Query::parse(bytes).map(|q| q.layout()), Ok(layout));
        Query {
            bytes,
            question_end: layout.question_end,
            opt: layout.opt,
        }
    }

    /// The packet as received.
    pub fn bytes(&self) -> &'a [u8] {
        self.bytes
    }

    pub fn id(&self) -> u16 {
        get16(self.bytes, header::ID).unwrap_or(0)
    }

    /// Recursion desired: echoed in the answer.
    pub fn rd(&self) -> bool {
        self.flags() & flags::RD != 0
    }

    /// Checking disabled (RFC 4035 §3.2.2): part of the key.
    pub fn cd(&self) -> bool {
        self.flags() & flags::CD != 0
    }

    /// The question's name in wire form exactly as sent (case preserved, so the answer can echo
    /// a 0x20-randomized name back).
    pub fn qname(&self) -> &'a [u8] {
        let end = usize::from(self.question_end).saturating_sub(4);
        self.bytes.get(HEADER_LEN..end).unwrap_or_default()
    }

    pub fn qtype(&self) -> u16 {
        get16(self.bytes, usize::from(self.question_end).saturating_sub(4)).unwrap_or(0)
    }

    pub fn qclass(&self) -> u16 {
        get16(self.bytes, usize::from(self.question_end).saturating_sub(2)).unwrap_or(0)
    }

    /// Bytes from offset 12 to the end of the question (name, type, class).
    pub fn question(&self) -> &'a [u8] {
        self.bytes
            .get(HEADER_LEN..usize::from(self.question_end))
            .unwrap_or_default()
    }

    /// The client's OPT record, if it sent one.
    pub fn edns(&self) -> Option<Edns> {
        let at = usize::from(self.opt?);
        // RFC 6891 §6.1.3: the TTL field is EXTENDED-RCODE (8), VERSION (8), DO (1), Z (15).
        let ttl = get32(self.bytes, at + 4)?;
        Some(Edns {
            udp_size: get16(self.bytes, at + 2)?,
            version: (ttl >> 16) as u8,
            dnssec_ok: ttl & 0x8000 != 0,
        })
    }

    /// Whether the client set DO (RFC 3225) in its OPT record.
    pub fn dnssec_ok(&self) -> bool {
        self.edns().is_some_and(|edns| edns.dnssec_ok)
    }

    /// The largest UDP answer this client accepts: 512 without EDNS, otherwise its advertised size
    /// clamped to [512, [`crate::EDNS_UDP_SIZE`]].
    pub fn udp_limit(&self) -> usize {
        match self.edns() {
            // RFC 6891 §6.2.3: values below 512 are treated as 512.
            Some(edns) => {
                usize::from(edns.udp_size).clamp(MIN_UDP_SIZE, usize::from(crate::EDNS_UDP_SIZE))
            }
            // RFC 1035 §4.2.1.
            None => MIN_UDP_SIZE,
        }
    }

    /// The cache key for this query.
    pub fn key(&self) -> Key {
        let mut key = Key::default();
        self.key_into(&mut key);
        key
    }

    /// Makes `key` this query's cache key (what [`Query::key`] returns), without building a
    /// new one.
    #[inline(always)]
    pub fn key_into(&self, key: &mut Key) {
        key.set(
            self.qname(),
            self.qtype(),
            self.qclass(),
            key::flag_bits(self.dnssec_ok(), self.cd()),
        );
    }

    /// The opcode (RFC 1035 §4.1.1); always 0 (QUERY) for a parsed query.
    pub fn opcode(&self) -> u8 {
        opcode(self.flags())
    }

    fn flags(&self) -> u16 {
        get16(self.bytes, header::FLAGS).unwrap_or(0)
    }
}

/// The 4-bit opcode from a flags word.
pub(crate) fn opcode(flags: u16) -> u8 {
    ((flags & flags::OPCODE_MASK) >> 11) as u8
}

/// Whether OPT RDATA is a sequence of whole {OPTION-CODE, OPTION-LENGTH, OPTION-DATA} triples
/// (RFC 6891 §6.1.2).
fn options_well_formed(mut rdata: &[u8]) -> bool {
    while !rdata.is_empty() {
        let Some(len) = get16(rdata, 2) else {
            return false;
        };
        match rdata.get(4 + usize::from(len)..) {
            Some(rest) => rdata = rest,
            None => return false,
        }
    }
    true
}

#[cfg(test)]
mod tests {
    use hickory_proto::op::{Message, MessageType, OpCode};
    use hickory_proto::rr::RecordType;

    use super::*;
    use crate::testutil::{encode, name, query_message};

    fn query_bytes(qname: &str, edns: Option<(u16, bool)>) -> Vec<u8> {
        encode(&query_message(0xBEEF, qname, RecordType::AAAA, edns))
    }

    #[test]
    fn parses_what_hickory_encodes() {
        let mut msg = query_message(
            0xBEEF,
            "WwW.ExAmple.com.",
            RecordType::AAAA,
            Some((4096, true)),
        );
        msg.metadata.checking_disabled = true;
        let bytes = encode(&msg);
        let query = Query::parse(&bytes).unwrap();
        assert_eq!(query.id(), 0xBEEF);
        assert!(query.rd());
        assert!(query.cd());
        assert_eq!(query.qname(), b"\x03WwW\x07ExAmple\x03com\x00");
        assert_eq!(query.qtype(), rtype::AAAA);
        assert_eq!(query.qclass(), 1);
        assert_eq!(
            query.question(),
            b"\x03WwW\x07ExAmple\x03com\x00\x00\x1c\x00\x01"
        );
        assert_eq!(
            query.edns(),
            Some(Edns {
                udp_size: 4096,
                version: 0,
                dnssec_ok: true
            })
        );
        assert_eq!(query.bytes(), &bytes[..]);
    }

    #[test]
    fn a_query_viewed_again_by_its_layout_reads_as_parsed() {
        for edns in [None, Some((4096, true))] {
            let bytes = query_bytes("WwW.ExAmple.com.", edns);
            let parsed = Query::parse(&bytes).unwrap();
            let again = Query::with_layout(&bytes, parsed.layout());
            assert_eq!(again.question(), parsed.question());
            assert_eq!(again.qtype(), rtype::AAAA);
            assert_eq!(again.edns(), parsed.edns());
            assert_eq!(again.udp_limit(), parsed.udp_limit());
            assert_eq!(again.key(), parsed.key());
        }
    }

    #[test]
    fn query_without_opt_has_no_edns() {
        let bytes = query_bytes("example.com.", None);
        let query = Query::parse(&bytes).unwrap();
        assert_eq!(query.edns(), None);
        assert!(!query.dnssec_ok());
        assert!(!query.cd());
        assert_eq!(query.udp_limit(), 512);
    }

    #[test]
    fn udp_limit_clamped_to_512_and_our_size() {
        let mut bytes = query_bytes("example.com.", Some((4096, false)));
        assert_eq!(Query::parse(&bytes).unwrap().udp_limit(), 1232);
        let class_at = bytes.len() - 11 + 3;
        bytes[class_at..class_at + 2].copy_from_slice(&100u16.to_be_bytes());
        assert_eq!(Query::parse(&bytes).unwrap().udp_limit(), 512);
        bytes[class_at..class_at + 2].copy_from_slice(&1000u16.to_be_bytes());
        assert_eq!(Query::parse(&bytes).unwrap().udp_limit(), 1000);
    }

    #[test]
    fn short_header_dropped() {
        let bytes = query_bytes("example.com.", None);
        for len in 0..HEADER_LEN {
            assert_eq!(
                Query::parse(&bytes[..len]).unwrap_err(),
                ParseError::ShortHeader
            );
        }
        assert_eq!(ParseError::ShortHeader.rcode(), None);
    }

    #[test]
    fn response_is_not_a_query() {
        let mut msg = query_message(1, "example.com.", RecordType::A, None);
        msg.metadata.message_type = MessageType::Response;
        assert_eq!(
            Query::parse(&encode(&msg)).unwrap_err(),
            ParseError::NotQuery
        );
        assert_eq!(ParseError::NotQuery.rcode(), None);
    }

    #[test]
    fn other_opcode_is_notimp() {
        let mut msg = query_message(1, "example.com.", RecordType::A, None);
        msg.metadata.op_code = OpCode::Notify;
        let err = Query::parse(&encode(&msg)).unwrap_err();
        assert_eq!(err, ParseError::Opcode(4));
        assert_eq!(err.rcode(), Some(rcode::NOTIMP.into()));
    }

    #[test]
    fn question_count_other_than_one_is_formerr() {
        let mut none = Message::new(1, MessageType::Query, OpCode::Query);
        none.metadata.recursion_desired = true;
        let mut two = query_message(1, "example.com.", RecordType::A, None);
        two.add_query(hickory_proto::op::Query::query(
            name("example.org."),
            RecordType::A,
        ));
        for msg in [none, two] {
            let err = Query::parse(&encode(&msg)).unwrap_err();
            assert_eq!(err, ParseError::QuestionCount);
            assert_eq!(err.rcode(), Some(rcode::FORMERR.into()));
        }
    }

    #[test]
    fn answer_or_authority_records_in_a_query_are_formerr() {
        for count_at in [header::ANCOUNT, header::NSCOUNT] {
            let mut bytes = query_bytes("example.com.", None);
            bytes[count_at + 1] = 1;
            assert_eq!(Query::parse(&bytes).unwrap_err(), ParseError::QuestionCount);
        }
    }

    /// An IXFR query carrying, as RFC 1995 §3 says, the SOA of the version the client holds.
    fn ixfr(with_opt: bool) -> Vec<u8> {
        let mut msg = query_message(7, "example.com.", RecordType::IXFR, None);
        let soa = hickory_proto::rr::rdata::SOA::new(
            name("ns.example.com."),
            name("hostmaster.example.com."),
            41,
            7200,
            1800,
            86400,
            300,
        );
        msg.add_authority(hickory_proto::rr::Record::from_rdata(
            name("example.com."),
            300,
            hickory_proto::rr::RData::SOA(soa),
        ));
        if with_opt {
            msg.set_edns(crate::testutil::edns(1232, false));
        }
        encode(&msg)
    }

    #[test]
    fn an_ixfr_may_carry_its_soa_in_the_authority_section() {
        for with_opt in [false, true] {
            let bytes = ixfr(with_opt);
            let query = Query::parse(&bytes).expect("a well-formed IXFR");
            assert_eq!(query.qtype(), rtype::IXFR);
            assert_eq!(query.edns().is_some(), with_opt);
        }
        // The same authority in any other query is not allowed.
        let mut other = ixfr(false);
        let qtype_at = HEADER_LEN + "\x07example\x03com\x00".len();
        other[qtype_at..qtype_at + 2].copy_from_slice(&rtype::AXFR.to_be_bytes());
        assert_eq!(Query::parse(&other).unwrap_err(), ParseError::QuestionCount);
        // An OPT is not an authority record.
        let mut opt_in_authority = raw_query(b"\x07example\x03com\x00\x00\xfb\x00\x01");
        opt_in_authority[header::NSCOUNT + 1] = 1;
        opt_in_authority.extend_from_slice(&[0, 0, 41, 4, 0xd0, 0, 0, 0, 0, 0, 0]);
        assert_eq!(
            Query::parse(&opt_in_authority).unwrap_err(),
            ParseError::BadAdditional
        );
    }

    /// A query with QDCOUNT 1 and the given raw question bytes.
    fn raw_query(question: &[u8]) -> Vec<u8> {
        let mut bytes = vec![0, 1, 1, 0, 0, 1, 0, 0, 0, 0, 0, 0];
        bytes.extend_from_slice(question);
        bytes
    }

    #[test]
    fn pointer_in_question_is_bad_name() {
        let err = Query::parse(&raw_query(b"\x03www\xc0\x00\x00\x01\x00\x01")).unwrap_err();
        assert_eq!(err, ParseError::BadName);
        assert_eq!(err.rcode(), Some(rcode::FORMERR.into()));
    }

    #[test]
    fn label_of_64_bytes_in_question_is_bad_name() {
        let mut question = vec![64];
        question.extend_from_slice(&[b'a'; 64]);
        question.extend_from_slice(&[0, 0, 1, 0, 1]);
        assert_eq!(
            Query::parse(&raw_query(&question)).unwrap_err(),
            ParseError::BadName
        );
    }

    #[test]
    fn name_of_256_bytes_in_question_is_bad_name() {
        // Four 63-byte labels (256 bytes) and the root: 257 bytes.
        let mut question = Vec::new();
        for _ in 0..4 {
            question.push(63);
            question.extend_from_slice(&[b'a'; 63]);
        }
        question.extend_from_slice(&[0, 0, 1, 0, 1]);
        assert_eq!(
            Query::parse(&raw_query(&question)).unwrap_err(),
            ParseError::BadName
        );
        // Three 63-byte labels and one of 61: exactly 255 bytes, accepted.
        let mut question = Vec::new();
        for len in [63, 63, 63, 61] {
            question.push(len);
            question.extend(std::iter::repeat_n(b'a', usize::from(len)));
        }
        question.extend_from_slice(&[0, 0, 1, 0, 1]);
        let bytes = raw_query(&question);
        assert_eq!(Query::parse(&bytes).unwrap().qname().len(), 255);
    }

    #[test]
    fn name_running_past_the_end_is_bad_name() {
        assert_eq!(
            Query::parse(&raw_query(b"\x07exam")).unwrap_err(),
            ParseError::BadName
        );
    }

    #[test]
    fn missing_type_or_class_is_truncated() {
        let err = Query::parse(&raw_query(b"\x07example\x00\x00\x01\x00")).unwrap_err();
        assert_eq!(err, ParseError::Truncated);
        assert_eq!(err.rcode(), Some(rcode::FORMERR.into()));
    }

    #[test]
    fn additional_record_cut_short_is_truncated() {
        let bytes = query_bytes("example.com.", Some((1232, false)));
        for cut in 1..11 {
            let err = Query::parse(&bytes[..bytes.len() - cut]).unwrap_err();
            assert_eq!(err, ParseError::Truncated, "cut {cut}");
        }
    }

    #[test]
    fn trailing_bytes_are_formerr() {
        let mut bytes = query_bytes("example.com.", Some((1232, false)));
        bytes.push(0);
        let err = Query::parse(&bytes).unwrap_err();
        assert_eq!(err, ParseError::TrailingBytes);
        assert_eq!(err.rcode(), Some(rcode::FORMERR.into()));
    }

    /// An OPT record with the given owner name bytes, version and RDATA.
    fn opt(owner: &[u8], version: u8, rdata: &[u8]) -> Vec<u8> {
        let mut rr = owner.to_vec();
        rr.extend_from_slice(&[0, 41, 0x04, 0xD0, 0, version, 0, 0]);
        rr.extend_from_slice(&(rdata.len() as u16).to_be_bytes());
        rr.extend_from_slice(rdata);
        rr
    }

    fn with_additional(records: &[Vec<u8>]) -> Vec<u8> {
        let mut bytes = query_bytes("example.com.", None);
        bytes[header::ARCOUNT + 1] = records.len() as u8;
        for rr in records {
            bytes.extend_from_slice(rr);
        }
        bytes
    }

    #[test]
    fn two_opt_records_are_bad_additional() {
        let bytes = with_additional(&[opt(b"\x00", 0, b""), opt(b"\x00", 0, b"")]);
        let err = Query::parse(&bytes).unwrap_err();
        assert_eq!(err, ParseError::BadAdditional);
        assert_eq!(err.rcode(), Some(rcode::FORMERR.into()));
    }

    #[test]
    fn opt_with_a_non_root_name_is_bad_additional() {
        let bytes = with_additional(&[opt(b"\x01a\x00", 0, b"")]);
        assert_eq!(Query::parse(&bytes).unwrap_err(), ParseError::BadAdditional);
        // A pointer to the root is not the root either (RFC 6891 §6.1.2: MUST be 0).
        let bytes = with_additional(&[opt(b"\xc0\x0c", 0, b"")]);
        assert_eq!(Query::parse(&bytes).unwrap_err(), ParseError::BadAdditional);
    }

    #[test]
    fn opt_with_a_cut_option_is_bad_additional() {
        let bytes = with_additional(&[opt(b"\x00", 0, b"\x00\x0a\x00\x08abcd")]);
        assert_eq!(Query::parse(&bytes).unwrap_err(), ParseError::BadAdditional);
        let bytes = with_additional(&[opt(b"\x00", 0, b"\x00\x0a\x00\x04abcd")]);
        assert!(Query::parse(&bytes).is_ok());
    }

    #[test]
    fn malformed_name_in_additional_is_bad_additional() {
        let mut rr = b"\xc0\x40".to_vec();
        rr.extend_from_slice(&[0, 250, 0, 255, 0, 0, 0, 0, 0, 0]);
        assert_eq!(
            Query::parse(&with_additional(&[rr])).unwrap_err(),
            ParseError::BadAdditional
        );
    }

    #[test]
    fn other_additional_records_are_skipped_over() {
        // A TSIG-like record owned by a compressed name pointing at the question.
        let mut tsig = b"\xc0\x0c".to_vec();
        tsig.extend_from_slice(&[0, 250, 0, 255, 0, 0, 0, 0, 0, 3, 1, 2, 3]);
        let bytes = with_additional(&[opt(b"\x00", 0, b""), tsig]);
        let query = Query::parse(&bytes).unwrap();
        assert_eq!(query.edns().map(|e| e.udp_size), Some(1232));
    }

    #[test]
    fn edns_version_other_than_zero_is_badvers() {
        let bytes = with_additional(&[opt(b"\x00", 1, b"")]);
        let err = Query::parse(&bytes).unwrap_err();
        assert_eq!(err, ParseError::BadVersion(1));
        assert_eq!(err.rcode(), Some(rcode::BADVERS));
    }

    #[test]
    fn malformed_packet_with_bad_version_is_formerr_first() {
        let mut bytes = with_additional(&[opt(b"\x00", 1, b"")]);
        bytes.push(0);
        assert_eq!(Query::parse(&bytes).unwrap_err(), ParseError::TrailingBytes);
    }

    #[test]
    fn key_lowercases_the_name_and_keeps_type_class_do_cd() {
        let mut msg = query_message(7, "WwW.ExAmple.COM.", RecordType::AAAA, Some((1232, true)));
        msg.metadata.checking_disabled = true;
        let bytes = encode(&msg);
        let key = Query::parse(&bytes).unwrap().key();
        assert_eq!(
            key.as_bytes(),
            b"\x03www\x07example\x03com\x00\x00\x1c\x00\x01\x03"
        );
        assert_eq!(key.qname(), b"\x03www\x07example\x03com\x00");
        assert_eq!(key.qtype(), rtype::AAAA);
        assert_eq!(key.qclass(), 1);
        assert!(key.dnssec_ok());
        assert!(key.checking_disabled());
    }

    #[test]
    fn keys_equal_across_case_and_differ_on_do() {
        let upper = query_bytes("EXAMPLE.com.", Some((1232, false)));
        let lower = query_bytes("example.com.", None);
        let with_do = query_bytes("example.com.", Some((1232, true)));
        let key = |b: &[u8]| Query::parse(b).unwrap().key();
        assert_eq!(key(&upper), key(&lower));
        assert_ne!(key(&lower), key(&with_do));
        // Equal keys hash equal (the cache may index by `Key` as well as by its bytes).
        use std::hash::BuildHasher;
        let state = std::collections::hash_map::RandomState::new();
        assert_eq!(state.hash_one(key(&upper)), state.hash_one(key(&lower)));
    }
}
