//! nodedns's wire code against hickory-proto's decoder, on the same bytes.
//!
//! The input is a 21-byte prefix that describes a client (see [`Client`]) followed by a message.
//! The message goes through `Query::parse` and `Reply::parse`, and hickory-proto reads it record
//! by record (its `Header`, `Query`, `Name` and `RData` decoders, with the offset of every part
//! noted) and whole (`Message::from_vec`). Every verdict and every field must agree, except where
//! the two are known to differ on purpose:
//!
//! nodedns refuses what hickory reads (nodedns is stricter):
//! - trailing bytes after the last record the counts announce;
//! - a query that is a response, has another opcode, not exactly one question, or answer or
//!   authority records; a reply that is not a response or has not exactly one question;
//! - a compression pointer in a question name (hickory accepts one into the header);
//! - a name that a pointer leads into the header, into a TTL field of an earlier record of a
//!   reply (both are rewritten on every answer served), or through more than 127 pointers, or
//!   whose pointer's second byte is the first byte of the name it was reached from;
//! - an OPT whose owner is not the single root byte (hickory accepts a pointer to the root), a
//!   second OPT, an OPT outside the additional section or, in a reply, not last;
//! - OPT options that do not exactly fill the OPT's RDATA (hickory drops a cut last option);
//! - a query with an EDNS version other than 0 (BADVERS);
//! - the first authority SOA of a reply, when its names and fields do not fill its RDATA;
//! - a reply over 65535 bytes.
//!
//! hickory refuses what nodedns reads (hickory is stricter): RDATA that hickory decodes by type
//! (an A of 5 bytes, a name inside a CNAME that points forwards, a TXT cut short, an EDNS option
//! such as a client subnet with bad contents), RDATA of a type that is not a record type (ANY,
//! AXFR, IXFR), empty RDATA outside an OPT, a SIG or TSIG outside the additional section: nodedns
//! copies RDATA as it came, except the names it walks (see `Reply::parse`).
//!
//! Everything else is asserted: a query's ID, flags, question and EDNS parameters; a reply's
//! header information, TTLs, negative TTL and stored bytes (the reply without its OPT); and the
//! answer written from it for a client asking the same question (in another letter case, with or
//! without EDNS, at a chosen size limit and TTL rule): ID, RD, AA, TC, the counts, the question
//! as the client sent it, the longest prefix of whole records that fits, each record's name,
//! type, class, RDATA (as hickory decodes it) and TTL as the rule gives it, and our OPT (left
//! out of a TCP answer the reply fills whole). A difference panics with a message that says
//! what differed.
#![no_main]

use std::ops::Range;

use hickory_proto::op::{Header, Message, MessageType, OpCode};
use hickory_proto::rr::{Name, RData, RecordType};
use hickory_proto::serialize::binary::{BinDecodable, BinDecoder, DecodeError, Restrict};
use libfuzzer_sys::fuzz_target;
use nodedns_wire::{ParseError, Query, Reply, ReplyError, TtlRule, flags, rtype};

/// Bytes of the client description before the message.
const PREFIX: usize = 21;

fuzz_target!(|data: &[u8]| {
    let (prefix, message) = data.split_at(data.len().min(PREFIX));
    let client = Client::read(prefix);
    query_agrees(message);
    reply_agrees(message, &client);
});

// ---------------------------------------------------------------------------------------------
// hickory's reading of a message, part by part.

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Section {
    Header,
    Question,
    Answer,
    Authority,
    Additional,
}

/// Which part of a record or question hickory could not read.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Part {
    Name,
    /// TYPE, CLASS (and TTL, RDLENGTH, RDATA length) of a record; TYPE, CLASS of a question.
    Fixed,
}

#[derive(Debug)]
struct Question {
    name: Name,
    name_end: usize,
    qtype: u16,
    qclass: u16,
    end: usize,
}

#[derive(Debug)]
struct Record {
    section: Section,
    start: usize,
    name: Name,
    rtype: u16,
    class: u16,
    ttl: u32,
    /// Offset of the TTL field.
    ttl_at: usize,
    rdata: Range<usize>,
    /// hickory's decoding of the RDATA (`Update0` for empty RDATA, as hickory's record reader
    /// makes it).
    data: Result<RData, DecodeError>,
}

#[derive(Debug)]
struct Stop {
    at: usize,
    section: Section,
    part: Part,
    error: DecodeError,
}

/// A message as hickory reads it: the header, then as many questions and records as the counts
/// announce, each located; `stop` says where hickory gave up, if it did.
#[derive(Debug)]
struct Walk {
    header: Option<Header>,
    questions: Vec<Question>,
    records: Vec<Record>,
    stop: Option<Stop>,
    /// Offset just past the last part read.
    end: usize,
}

impl Walk {
    fn read(bytes: &[u8]) -> Walk {
        let mut walk = Walk {
            header: None,
            questions: Vec::new(),
            records: Vec::new(),
            stop: None,
            end: 0,
        };
        // Offsets are 16-bit in hickory's decoder (`BinDecoder::clone`).
        if bytes.len() > usize::from(u16::MAX) {
            return walk;
        }
        let mut decoder = BinDecoder::new(bytes);
        let header = match Header::read(&mut decoder) {
            Ok(header) => header,
            Err(error) => {
                walk.stop = Some(Stop {
                    at: 0,
                    section: Section::Header,
                    part: Part::Fixed,
                    error,
                });
                return walk;
            }
        };
        walk.header = Some(header);
        let counts = header.counts;
        for _ in 0..counts.queries {
            match read_question(&mut decoder) {
                Ok(question) => walk.questions.push(question),
                Err((at, part, error)) => {
                    walk.stop = Some(Stop {
                        at,
                        section: Section::Question,
                        part,
                        error,
                    });
                    return walk;
                }
            }
        }
        for (section, count) in [
            (Section::Answer, counts.answers),
            (Section::Authority, counts.authorities),
            (Section::Additional, counts.additionals),
        ] {
            for _ in 0..count {
                match read_record(&mut decoder, section) {
                    Ok(record) => walk.records.push(record),
                    Err((at, part, error)) => {
                        walk.stop = Some(Stop {
                            at,
                            section,
                            part,
                            error,
                        });
                        return walk;
                    }
                }
            }
        }
        walk.end = decoder.index();
        walk
    }

    /// The walk, if hickory read every part the counts announce.
    fn complete(&self) -> Result<&Walk, String> {
        match &self.stop {
            None if self.header.is_some() => Ok(self),
            None => Err("longer than 65535 bytes".into()),
            Some(stop) => Err(format!(
                "hickory stops at {} ({:?} {:?}): {}",
                stop.at, stop.section, stop.part, stop.error
            )),
        }
    }

    fn header(&self) -> Header {
        self.header.expect("a complete walk has a header")
    }

    fn opts(&self) -> impl Iterator<Item = (usize, &Record)> {
        self.records
            .iter()
            .enumerate()
            .filter(|(_, r)| r.rtype == rtype::OPT)
    }

    /// Offsets of the TTL fields of the records (OPT excluded) before `before`.
    fn ttls_before(&self, before: usize) -> Vec<usize> {
        self.records
            .iter()
            .filter(|r| r.rtype != rtype::OPT && r.ttl_at < before)
            .map(|r| r.ttl_at)
            .collect()
    }

    /// Why `Message::from_vec` must fail on a message whose walk is complete, if it must:
    /// hickory's rules beyond the structure.
    fn message_rule_broken(&self) -> Option<String> {
        let header = self.header();
        let mut opts = 0;
        for record in &self.records {
            let rtype = RecordType::from(record.rtype);
            if let Err(error) = &record.data {
                return Some(format!("RDATA at {}: {error}", record.rdata.start));
            }
            if record.rdata.is_empty()
                && rtype != RecordType::OPT
                && header.op_code != OpCode::Update
            {
                return Some(format!("empty RDATA at {}", record.rdata.start));
            }
            if record.section != Section::Additional
                && matches!(rtype, RecordType::OPT | RecordType::SIG | RecordType::TSIG)
            {
                return Some(format!("{rtype} outside the additional section"));
            }
            if rtype == RecordType::OPT {
                if !record.name.is_root() {
                    return Some("OPT owner is not the root".into());
                }
                opts += 1;
                if opts > 1 {
                    return Some("two OPT records".into());
                }
            }
        }
        None
    }
}

fn read_question(d: &mut BinDecoder<'_>) -> Result<Question, (usize, Part, DecodeError)> {
    let start = d.index();
    let name = Name::read(d).map_err(|e| (start, Part::Name, e))?;
    let name_end = d.index();
    let fixed = |d: &mut BinDecoder<'_>| -> Result<(u16, u16), DecodeError> {
        Ok((d.read_u16()?.unverified(), d.read_u16()?.unverified()))
    };
    let (qtype, qclass) = fixed(d).map_err(|e| (name_end, Part::Fixed, e))?;
    Ok(Question {
        name,
        name_end,
        qtype,
        qclass,
        end: d.index(),
    })
}

fn read_record(
    d: &mut BinDecoder<'_>,
    section: Section,
) -> Result<Record, (usize, Part, DecodeError)> {
    let start = d.index();
    let name = Name::read(d).map_err(|e| (start, Part::Name, e))?;
    let fixed = d.index();
    let read = |d: &mut BinDecoder<'_>| -> Result<(u16, u16, u32, u16), DecodeError> {
        Ok((
            d.read_u16()?.unverified(),
            d.read_u16()?.unverified(),
            d.read_u32()?.unverified(),
            d.read_u16()?.unverified(),
        ))
    };
    let (rtype, class, ttl, rdlen) = read(d).map_err(|e| (fixed, Part::Fixed, e))?;
    let rdata_start = d.index();
    d.read_slice(usize::from(rdlen))
        .map_err(|e| (fixed, Part::Fixed, e))?;
    let data = if rdlen == 0 {
        Ok(RData::Update0(RecordType::from(rtype)))
    } else {
        // RDATA names may point anywhere before them: decode in the whole message.
        let mut rdata = d.clone(rdata_start as u16);
        RData::read(&mut rdata, RecordType::from(rtype), Restrict::new(rdlen))
    };
    Ok(Record {
        section,
        start,
        name,
        rtype,
        class,
        ttl,
        ttl_at: fixed + 4,
        rdata: rdata_start..d.index(),
        data,
    })
}

/// The wire length of a name, uncompressed.
fn wire_len(name: &Name) -> usize {
    name.iter().map(|label| 1 + label.len()).sum::<usize>() + 1
}

/// The labels of an uncompressed wire name (as nodedns returns a qname).
fn labels(mut wire: &[u8]) -> Vec<&[u8]> {
    let mut out = Vec::new();
    while let Some((&len, rest)) = wire.split_first() {
        if len == 0 || usize::from(len) > rest.len() {
            break;
        }
        out.push(&rest[..usize::from(len)]);
        wire = &rest[usize::from(len)..];
    }
    out
}

/// Whether hickory's name has exactly these labels, letter case included.
fn same_labels(name: &Name, wire: &[u8]) -> bool {
    name.iter().eq(labels(wire))
}

/// What reading a name (one hickory accepted) along its pointers did that nodedns forbids.
#[derive(Debug, Default)]
struct Trace {
    /// A pointer into the 12-byte header.
    into_header: bool,
    /// Pointers followed.
    jumps: usize,
    /// A pointer whose second byte lies at or past the start of the name it was reached from
    /// (hickory only checks where each label or pointer starts).
    straddles: bool,
    /// The bytes read after the first pointer (labels, pointers, the root byte).
    read: Vec<Range<usize>>,
}

impl Trace {
    /// Follows the name at `start` as hickory does (RFC 1035 §4.1.4: a pointer to a prior
    /// occurrence; after a pointer, every label before where the previous run began).
    fn of(bytes: &[u8], start: usize) -> Trace {
        let mut trace = Trace::default();
        let mut pos = start;
        let mut run_start = start;
        let mut limit = None;
        // hickory accepted the name, so pointers strictly decrease; bounded anyway.
        for _ in 0..bytes.len() + 1 {
            let Some(&len) = bytes.get(pos) else {
                break;
            };
            let jumped = limit.is_some();
            if len & 0xC0 == 0xC0 {
                if jumped {
                    trace.read.push(pos..pos + 2);
                    if limit.is_some_and(|limit| pos + 2 > limit) {
                        trace.straddles = true;
                    }
                }
                let low = bytes.get(pos + 1).copied().unwrap_or(0);
                let target = usize::from(len & 0x3F) << 8 | usize::from(low);
                trace.into_header |= target < 12;
                trace.jumps += 1;
                limit = Some(run_start);
                run_start = target;
                pos = target;
            } else {
                let next = pos + 1 + usize::from(len);
                if jumped {
                    trace.read.push(pos..next);
                }
                if len == 0 {
                    break;
                }
                pos = next;
            }
        }
        trace
    }

    /// Whether a byte read through a pointer is one of the 4-byte fields at `fields`.
    fn reads_fields(&self, fields: &[usize]) -> bool {
        self.read.iter().any(|range| {
            fields
                .iter()
                .any(|&at| range.start < at + 4 && at < range.end)
        })
    }

    /// The rules of nodedns's name walk beyond hickory's (see `name.rs`), with the TTL fields
    /// `ttls` a name must not read.
    fn broken_rule(&self, ttls: &[usize]) -> Option<&'static str> {
        if self.into_header {
            Some("a pointer into the header")
        } else if self.jumps > 127 {
            Some("more than 127 pointers")
        } else if self.straddles {
            Some("a pointer cut by the start of the name it was reached from")
        } else if self.reads_fields(ttls) {
            Some("a name read from a TTL field")
        } else {
            None
        }
    }
}

/// Whether OPT RDATA is a sequence of whole {code, length, data} options (RFC 6891 §6.1.2).
fn options_framed(mut rdata: &[u8]) -> bool {
    while !rdata.is_empty() {
        let Some(&[_, _, hi, lo]) = rdata.get(..4) else {
            return false;
        };
        let len = usize::from(u16::from_be_bytes([hi, lo]));
        match rdata.get(4 + len..) {
            Some(rest) => rdata = rest,
            None => return false,
        }
    }
    true
}

/// hickory's full decoding must fail exactly when one of its rules beyond the structure is
/// broken (this keeps the walk honest: it reads what `Message::from_vec` reads).
fn walk_matches_message(walk: &Walk, bytes: &[u8]) {
    let message = Message::from_vec(bytes);
    match (walk.complete(), &message) {
        (Ok(walk), Ok(_)) => {
            if let Some(rule) = walk.message_rule_broken() {
                panic!("oracle: hickory decoded a message breaking its rule ({rule})");
            }
        }
        (Ok(walk), Err(error)) => {
            assert!(
                walk.message_rule_broken().is_some(),
                "oracle: the walk reads what hickory's decoder refuses ({error})"
            );
        }
        (Err(_), Ok(_)) => panic!("oracle: hickory decodes what the walk cannot read"),
        (Err(_), Err(_)) => {}
    }
}

// ---------------------------------------------------------------------------------------------
// Queries.

fn query_agrees(bytes: &[u8]) {
    let walk = Walk::read(bytes);
    walk_matches_message(&walk, bytes);
    match Query::parse(bytes) {
        Ok(query) => query_fields_agree(&query, &walk, bytes),
        Err(error) => {
            if let Err(why) = query_refusal_justified(error, &walk, bytes) {
                panic!("Query::parse refused with {error:?} a query hickory reads: {why}");
            }
        }
    }
}

fn query_fields_agree(query: &Query<'_>, walk: &Walk, bytes: &[u8]) {
    let walk = walk
        .complete()
        .unwrap_or_else(|why| panic!("Query::parse accepted a query hickory cannot read: {why}"));
    let header = walk.header();
    assert_eq!(walk.end, bytes.len(), "accepted with trailing bytes");
    assert_eq!(header.message_type, MessageType::Query);
    assert_eq!(header.op_code, OpCode::Query);
    assert_eq!(
        (
            header.counts.queries,
            header.counts.answers,
            header.counts.authorities
        ),
        (1, 0, 0)
    );
    assert_eq!(query.id(), header.id, "ID");
    assert_eq!(query.rd(), header.recursion_desired, "RD");
    assert_eq!(query.cd(), header.checking_disabled, "CD");
    assert_eq!(query.opcode(), 0);

    let question = &walk.questions[0];
    assert_eq!(query.qname(), &bytes[12..question.name_end], "qname bytes");
    assert!(
        same_labels(&question.name, query.qname()),
        "qname: hickory reads {:?}, nodedns {:02x?}",
        question.name,
        query.qname()
    );
    assert_eq!(
        wire_len(&question.name),
        query.qname().len(),
        "a compressed question accepted"
    );
    assert_eq!(query.qtype(), question.qtype, "QTYPE");
    assert_eq!(query.qclass(), question.qclass, "QCLASS");
    assert_eq!(query.question(), &bytes[12..question.end]);

    let opts: Vec<_> = walk.opts().collect();
    assert!(opts.len() <= 1, "two OPT records accepted");
    match (query.edns(), opts.first()) {
        (None, None) => assert_eq!(query.udp_limit(), 512),
        (Some(edns), Some((_, opt))) => {
            assert_eq!(&bytes[opt.start..opt.start + 1], [0], "OPT owner");
            assert_eq!(edns.udp_size, opt.class, "UDP size");
            assert_eq!(edns.version, (opt.ttl >> 16) as u8, "EDNS version");
            assert_eq!(edns.version, 0, "a query of EDNS version > 0 accepted");
            assert_eq!(edns.dnssec_ok, opt.ttl & 0x8000 != 0, "DO");
            assert!(
                options_framed(&bytes[opt.rdata.clone()]),
                "accepted cut options"
            );
            let expected = usize::from(opt.class).clamp(512, 1232);
            assert_eq!(query.udp_limit(), expected, "UDP limit");
        }
        (ours, theirs) => panic!("EDNS: nodedns {ours:?}, hickory {theirs:?}"),
    }
    for record in &walk.records {
        let trace = Trace::of(bytes, record.start);
        if let Some(rule) = trace.broken_rule(&[]) {
            panic!("accepted an additional record's name with {rule}");
        }
    }

    // The key: the name lowercased, type, class, DO and CD.
    let key = query.key();
    assert_eq!(key.qname(), query.qname().to_ascii_lowercase());
    assert!(same_labels(&question.name.to_lowercase(), key.qname()));
    assert_eq!(
        (key.qtype(), key.qclass()),
        (question.qtype, question.qclass)
    );
    assert_eq!(key.dnssec_ok(), query.dnssec_ok());
    assert_eq!(key.checking_disabled(), header.checking_disabled);
}

/// Whether hickory reads a name at offset 12 without following a pointer (RFC 1035 §4.1.4:
/// nothing precedes the question's name but the header).
fn question_name_uncompressed(bytes: &[u8]) -> bool {
    let mut decoder = BinDecoder::new(bytes).clone(12);
    Name::read(&mut decoder).is_ok_and(|name| decoder.index() - 12 == wire_len(&name))
}

/// Why refusing this query is right, or what hickory reads in it instead.
fn query_refusal_justified(error: ParseError, walk: &Walk, bytes: &[u8]) -> Result<(), String> {
    if bytes.len() < 12 {
        return match error {
            ParseError::ShortHeader => Ok(()),
            _ => Err("a packet shorter than a header".into()),
        };
    }
    let header = walk.header.expect("12 bytes are a header");
    let counts = header.counts;
    let ok_if = |holds: bool, what: &str| if holds { Ok(()) } else { Err(what.to_owned()) };
    match error {
        ParseError::ShortHeader => Err("12 bytes or more".into()),
        ParseError::NotQuery => ok_if(header.message_type == MessageType::Response, "QR is clear"),
        ParseError::Opcode(opcode) => ok_if(
            header.op_code != OpCode::Query && u8::from(header.op_code) == opcode,
            &format!("opcode {:?}", header.op_code),
        ),
        ParseError::QuestionCount => ok_if(
            counts.queries != 1 || counts.answers != 0 || counts.authorities != 0,
            "one question, no answer or authority records",
        ),
        ParseError::BadName => ok_if(
            !question_name_uncompressed(bytes),
            "hickory reads an uncompressed question name",
        ),
        ParseError::Truncated | ParseError::BadAdditional => {
            if let Some(stop) = &walk.stop {
                // The question's name is whole (nodedns checked it first): hickory stops in
                // the question's type and class, in the additional section, or in the
                // authority section, which nodedns reads only for an IXFR's SOA (RFC 1995 §3).
                return ok_if(
                    (stop.section == Section::Question && stop.part == Part::Fixed)
                        || stop.section == Section::Additional
                        || (stop.section == Section::Authority && counts.authorities > 0),
                    &format!("hickory stops elsewhere: {stop:?}"),
                );
            }
            if error == ParseError::Truncated {
                return Err("hickory reads every record".into());
            }
            let opts: Vec<_> = walk.opts().collect();
            if opts.len() > 1 {
                return Ok(());
            }
            for (_, opt) in &opts {
                if bytes[opt.start] != 0 || opt.rdata.start != opt.start + 11 {
                    return Ok(());
                }
                if !options_framed(&bytes[opt.rdata.clone()]) {
                    return Ok(());
                }
            }
            for record in &walk.records {
                if Trace::of(bytes, record.start).broken_rule(&[]).is_some() {
                    return Ok(());
                }
            }
            Err("every additional record is well-formed".into())
        }
        ParseError::TrailingBytes => {
            let walk = walk.complete()?;
            ok_if(walk.end < bytes.len(), "no bytes after the last record")
        }
        ParseError::BadVersion(version) => {
            let walk = walk.complete()?;
            let versions: Vec<u8> = walk.opts().map(|(_, o)| (o.ttl >> 16) as u8).collect();
            ok_if(
                version != 0 && versions == [version],
                &format!("EDNS versions {versions:?}"),
            )
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Replies, and the answers written from them.

fn reply_agrees(bytes: &[u8], client: &Client) {
    let walk = Walk::read(bytes);
    // (Already checked against `Message::from_vec` by `query_agrees`.)
    match Reply::parse(bytes) {
        Ok(reply) => {
            let walk = walk.complete().unwrap_or_else(|why| {
                panic!("Reply::parse accepted a reply hickory cannot read: {why}")
            });
            reply_fields_agree(&reply, walk, bytes);
            serve_agrees(&reply, walk, bytes, client);
        }
        Err(error) => {
            if let Err(why) = reply_refusal_justified(error, &walk, bytes) {
                panic!("Reply::parse refused with {error:?} a reply hickory reads: {why}");
            }
        }
    }
}

/// RFC 2181 §8.
fn sane(ttl: u32) -> u32 {
    if ttl > i32::MAX as u32 { 0 } else { ttl }
}

fn reply_fields_agree(reply: &Reply, walk: &Walk, bytes: &[u8]) {
    let header = walk.header();
    assert_eq!(walk.end, bytes.len(), "accepted with trailing bytes");
    assert_eq!(header.message_type, MessageType::Response);
    assert_eq!(header.counts.queries, 1);
    let question = &walk.questions[0];
    assert_eq!(
        wire_len(&question.name),
        question.name_end - 12,
        "a compressed question accepted"
    );
    assert_eq!(reply.question(), &bytes[12..question.end], "question");

    let opts: Vec<_> = walk.opts().collect();
    let opt = match opts[..] {
        [] => None,
        [(index, opt)] => {
            assert_eq!(index + 1, walk.records.len(), "an OPT that is not last");
            assert_eq!(opt.section, Section::Additional, "OPT section");
            assert_eq!(
                opt.rdata.start,
                opt.start + 11,
                "an OPT owner that is not the root"
            );
            Some(opt)
        }
        _ => panic!("two OPT records accepted"),
    };
    let first_soa = walk
        .records
        .iter()
        .position(|r| r.section == Section::Authority && r.rtype == rtype::SOA);
    for (index, record) in walk.records.iter().enumerate() {
        let ttls = walk.ttls_before(record.start);
        if let Some(rule) = Trace::of(bytes, record.start).broken_rule(&ttls) {
            panic!("accepted an owner name at {} with {rule}", record.start);
        }
        if rdata_names_refused(bytes, walk, record, first_soa == Some(index)) {
            panic!("accepted the names in the RDATA at {}", record.rdata.start);
        }
    }

    let info = reply.info();
    // RFC 6891 §6.1.3: the OPT's TTL holds the upper 8 bits of a 12-bit RCODE.
    let low = u16::from(bytes[3] & 0x0F);
    let rcode = opt.map_or(low, |opt| ((opt.ttl >> 24) as u16) << 4 | low);
    assert_eq!(info.rcode, rcode, "RCODE");
    assert_eq!(info.truncated, header.truncation, "TC");
    assert_eq!(info.authentic_data, header.authentic_data, "AD");
    assert_eq!(info.answers, header.counts.answers, "ANCOUNT");
    let others = walk.records.iter().filter(|r| r.rtype != rtype::OPT);
    assert_eq!(
        info.min_ttl,
        others.clone().map(|r| sane(r.ttl)).min(),
        "minimum TTL"
    );
    let soa = walk
        .records
        .iter()
        .find(|r| r.section == Section::Authority && r.rtype == rtype::SOA);
    let negative = soa.map(|soa| match &soa.data {
        Ok(RData::SOA(data)) => sane(soa.ttl).min(sane(data.minimum)),
        other => panic!("accepted an authority SOA hickory reads as {other:?}"),
    });
    assert_eq!(info.negative_ttl, negative, "negative TTL");

    // What is stored: the reply without its OPT, ARCOUNT lowered.
    let mut stored = bytes[..opt.map_or(bytes.len(), |o| o.start)].to_vec();
    if opt.is_some() {
        let arcount = header.counts.additionals - 1;
        stored[10..12].copy_from_slice(&arcount.to_be_bytes());
    }
    assert_eq!(reply.bytes(), stored, "stored bytes");
    assert_eq!(
        reply.heap_size(),
        stored.len() + 2 * others.count(),
        "heap size"
    );
}

/// Why refusing this reply is right, or what hickory reads in it instead.
fn reply_refusal_justified(error: ReplyError, walk: &Walk, bytes: &[u8]) -> Result<(), String> {
    if bytes.len() > usize::from(u16::MAX) {
        return match error {
            ReplyError::TooLarge => Ok(()),
            _ => Err("over 65535 bytes".into()),
        };
    }
    if bytes.len() < 12 {
        return match error {
            ReplyError::ShortHeader => Ok(()),
            _ => Err("a packet shorter than a header".into()),
        };
    }
    let header = walk.header.expect("12 bytes are a header");
    let ok_if = |holds: bool, what: &str| if holds { Ok(()) } else { Err(what.to_owned()) };
    match error {
        ReplyError::ShortHeader | ReplyError::TooLarge => Err("12 to 65535 bytes".into()),
        ReplyError::NotResponse => ok_if(header.message_type == MessageType::Query, "QR is set"),
        ReplyError::QuestionCount => ok_if(header.counts.queries != 1, "one question"),
        ReplyError::BadName | ReplyError::Truncated => {
            if let Some(stop) = &walk.stop {
                // hickory stops too. (Which of the two nodedns says depends on whether the
                // name runs past the end or breaks a rule; both refuse the reply.)
                return ok_if(
                    stop.section != Section::Header,
                    &format!("hickory stops elsewhere: {stop:?}"),
                );
            }
            if !question_name_uncompressed(bytes) {
                return Ok(());
            }
            for record in &walk.records {
                let ttls = walk.ttls_before(record.start);
                if Trace::of(bytes, record.start).broken_rule(&ttls).is_some() {
                    return Ok(());
                }
            }
            // Names in RDATA, which nodedns walks for the types whose RDATA names receivers
            // decompress; the first authority SOA's, which it reads the MINIMUM of.
            let first_soa = walk
                .records
                .iter()
                .position(|r| r.section == Section::Authority && r.rtype == rtype::SOA);
            for (index, record) in walk.records.iter().enumerate() {
                if rdata_names_refused(bytes, walk, record, first_soa == Some(index)) {
                    return Ok(());
                }
            }
            Err("every name is well-formed".into())
        }
        ReplyError::TrailingBytes => {
            let walk = walk.complete()?;
            ok_if(walk.end < bytes.len(), "no bytes after the last record")
        }
        ReplyError::BadOpt => {
            // nodedns stops at the first misplaced OPT; hickory may stop later or not at all.
            let counts = header.counts;
            let total = usize::from(counts.answers)
                + usize::from(counts.authorities)
                + usize::from(counts.additionals);
            let last = total.saturating_sub(1);
            let misplaced = walk.opts().count() > 1
                || walk.opts().any(|(index, opt)| {
                    index != last
                        || opt.section != Section::Additional
                        || opt.rdata.start != opt.start + 11
                        || bytes[opt.start] != 0
                });
            ok_if(misplaced, "one OPT, last, owned by the root")
        }
    }
}

/// Where nodedns looks for names in RDATA (`RdataNames` in `reply.rs`): for a type, the bytes of
/// fixed fields before its first name and how many names follow; NAPTR has three
/// character-strings between its fixed fields and its name.
fn rdata_names(rtype: u16) -> Option<(usize, usize)> {
    Some(match rtype {
        2 | 3 | 4 | 5 | 7 | 8 | 9 | 12 | 30 | 39 | 250 | 65305 => (0, 1),
        6 | 14 | 17 => (0, 2),
        15 | 18 | 21 | 64 | 65 => (2, 1),
        26 => (2, 2),
        24 => (18, 1),
        33 => (6, 1),
        35 => (4, 1),
        _ => return None,
    })
}

/// Whether nodedns must refuse `record` for the names in its RDATA: one that hickory's name
/// decoder cannot read there within the RDATA, or that breaks a rule of nodedns's name walk (the
/// record's own TTL is rewritten too), or RDATA too short to hold them; for the first authority
/// SOA also fields that do not fill the RDATA after its names.
fn rdata_names_refused(bytes: &[u8], walk: &Walk, record: &Record, first_soa: bool) -> bool {
    let Some((skip, count)) = rdata_names(record.rtype) else {
        return false;
    };
    let rdata = &bytes[..record.rdata.end];
    let mut at = record.rdata.start + skip;
    if record.rtype == 35 {
        for _ in 0..3 {
            match rdata.get(at) {
                Some(&len) => at += 1 + usize::from(len),
                None => return true,
            }
        }
    }
    let ttls = walk.ttls_before(record.rdata.start);
    for _ in 0..count {
        if at >= rdata.len() {
            return true;
        }
        let mut decoder = BinDecoder::new(rdata).clone(at as u16);
        if Name::read(&mut decoder).is_err() {
            return true;
        }
        if Trace::of(bytes, at).broken_rule(&ttls).is_some() {
            return true;
        }
        at = decoder.index();
    }
    first_soa && at + 20 != record.rdata.end
}

// ---------------------------------------------------------------------------------------------
// The client an answer is written for.

/// The query a client sends for the reply's question, and how the answer is written for it.
/// Read from the input's first bytes (missing bytes are 0):
///
/// | bytes | field |
/// | --- | --- |
/// | 0–1 | ID |
/// | 2 | bit 0 RD, bit 1 an OPT, bit 2 DO, bit 3 CD, bit 4 relayed (else served from the cache), bits 5–6 the question: 0–1 the reply's, 2 another QTYPE, 3 another name |
/// | 3–4 | the OPT's UDP size |
/// | 5–8 | which letters of the name change case (bit i for the i-th letter, cyclically) |
/// | 9 | limit: 0 the client's UDP limit, 1 65535, 2 bytes 10–11, 3 bytes 10–11 modulo the answer's whole size + 1 |
/// | 10–11 | limit value |
/// | 12–15 | TTL rule: age |
/// | 16–19 | TTL rule: cap |
/// | 20 | TTL rule: floor |
#[derive(Debug)]
struct Client {
    id: u16,
    rd: bool,
    edns: Option<(u16, bool)>,
    cd: bool,
    relayed: bool,
    question: u8,
    flips: u32,
    limit_mode: u8,
    limit: u16,
    ttl: TtlRule,
}

impl Client {
    fn read(prefix: &[u8]) -> Client {
        let mut p = [0u8; PREFIX];
        p[..prefix.len()].copy_from_slice(prefix);
        let bits = p[2];
        Client {
            id: u16::from_be_bytes([p[0], p[1]]),
            rd: bits & 1 != 0,
            edns: (bits & 2 != 0).then_some((u16::from_be_bytes([p[3], p[4]]), bits & 4 != 0)),
            cd: bits & 8 != 0,
            relayed: bits & 16 != 0,
            question: (bits >> 5) & 3,
            flips: u32::from_be_bytes([p[5], p[6], p[7], p[8]]),
            limit_mode: p[9] & 3,
            limit: u16::from_be_bytes([p[10], p[11]]),
            ttl: TtlRule {
                age: u32::from_be_bytes([p[12], p[13], p[14], p[15]]),
                cap: u32::from_be_bytes([p[16], p[17], p[18], p[19]]),
                floor: u32::from(p[20]),
            },
        }
    }

    /// The client's query for `question` (the reply's), and whether it asks that question.
    fn query(&self, question: &[u8]) -> Option<(Vec<u8>, bool)> {
        let name_len = question.len() - 4;
        let mut name: Vec<u8> = Vec::with_capacity(name_len + 2);
        let mut letter = 0;
        for &b in &question[..name_len] {
            // Length bytes (at most 63) are never letters: only label text changes.
            if b.is_ascii_alphabetic() {
                let flip = self.flips >> (letter % 32) & 1 != 0;
                letter += 1;
                name.push(if flip { b ^ 0x20 } else { b });
            } else {
                name.push(b);
            }
        }
        let mut tail = question[name_len..].to_vec();
        let same = match self.question {
            2 => {
                tail[1] ^= 1;
                false
            }
            3 => {
                if name.len() + 2 > 255 {
                    return None;
                }
                name.splice(0..0, [1, b'x']);
                false
            }
            _ => true,
        };
        let mut flags = 0u16;
        if self.rd {
            flags |= flags::RD;
        }
        if self.cd {
            flags |= flags::CD;
        }
        let mut query = Vec::new();
        query.extend_from_slice(&self.id.to_be_bytes());
        query.extend_from_slice(&flags.to_be_bytes());
        query.extend_from_slice(&[0, 1, 0, 0, 0, 0, 0, u8::from(self.edns.is_some())]);
        query.extend_from_slice(&name);
        query.extend_from_slice(&tail);
        if let Some((size, dnssec_ok)) = self.edns {
            query.push(0);
            query.extend_from_slice(&rtype::OPT.to_be_bytes());
            query.extend_from_slice(&size.to_be_bytes());
            query.extend_from_slice(&[0, 0, if dnssec_ok { 0x80 } else { 0 }, 0, 0, 0]);
        }
        Some((query, same))
    }
}

/// The answer written from `reply` for the client agrees with what hickory reads in the reply.
fn serve_agrees(reply: &Reply, walk: &Walk, bytes: &[u8], client: &Client) {
    let stored_question = &bytes[12..walk.questions[0].end];
    let Some((query_bytes, same_question)) = client.query(stored_question) else {
        return;
    };
    let query = Query::parse(&query_bytes)
        .unwrap_or_else(|e| panic!("the client's query does not parse: {e:?}"));
    query_agrees(&query_bytes);

    let opt_len = if client.edns.is_some() { 11 } else { 0 };
    let whole = reply.bytes().len() + opt_len;
    let limit = match client.limit_mode {
        0 => query.udp_limit(),
        1 => 65535,
        2 => usize::from(client.limit),
        _ => usize::from(client.limit) % (whole + 1),
    };
    for limit in [limit, 65535] {
        let mut out = Vec::new();
        if client.relayed {
            reply.write_relayed(&query, client.ttl, limit, &mut out);
        } else {
            reply.write_answer(&query, client.ttl, limit, &mut out);
        }
        answer_agrees(
            &out,
            reply,
            walk,
            bytes,
            client,
            &query,
            same_question,
            limit,
        );
    }
}

#[allow(clippy::too_many_arguments)]
fn answer_agrees(
    out: &[u8],
    reply: &Reply,
    walk: &Walk,
    bytes: &[u8],
    client: &Client,
    query: &Query<'_>,
    same_question: bool,
    limit: usize,
) {
    let header = walk.header();
    // A reply that fills a whole TCP message leaves no room for our OPT: it goes whole without
    // one rather than cut.
    let stored = reply.bytes().len();
    let no_room = limit >= 65535 && stored + 11 > limit && stored <= limit;
    let edns = client.edns.filter(|_| !no_room);
    let opt_len = if edns.is_some() { 11 } else { 0 };
    let records: Vec<&Record> = walk
        .records
        .iter()
        .filter(|r| r.rtype != rtype::OPT)
        .collect();
    let question_end = walk.questions[0].end;
    // What fits: the whole, or the longest prefix of whole records, in message order.
    let full = reply.bytes().len() + opt_len <= limit;
    let budget = limit.saturating_sub(opt_len);
    let kept = if full {
        records.len()
    } else {
        records.iter().take_while(|r| r.rdata.end <= budget).count()
    };
    let body_end = kept
        .checked_sub(1)
        .map_or(question_end, |last| records[last].rdata.end);
    assert_eq!(
        out.len(),
        body_end + opt_len,
        "answer length for limit {limit}: {kept} of {} records kept",
        records.len()
    );
    if out.len() > limit {
        assert_eq!(kept, 0, "beyond the limit with records");
    }

    let served = Walk::read(out);
    let served = served
        .complete()
        .unwrap_or_else(|why| panic!("hickory cannot read the answer: {why}"));
    assert_eq!(served.end, out.len(), "the answer has trailing bytes");
    if Message::from_vec(bytes).is_ok() {
        // What hickory decodes whole, it decodes whole once served.
        if let Err(e) = Message::from_vec(out) {
            panic!("hickory decodes the reply but not the answer: {e}");
        }
    }

    // Header.
    let h = served.header();
    assert_eq!(h.id, client.id, "ID");
    assert_eq!(h.message_type, MessageType::Response, "QR");
    assert_eq!(h.op_code, header.op_code, "opcode");
    assert_eq!(h.recursion_desired, client.rd, "RD");
    assert_eq!(
        h.authoritative,
        header.authoritative || !client.relayed,
        "AA (relayed: {})",
        client.relayed
    );
    assert_eq!(h.truncation, header.truncation || !full, "TC");
    assert_eq!(h.recursion_available, header.recursion_available, "RA");
    assert_eq!(h.authentic_data, header.authentic_data, "AD");
    assert_eq!(h.checking_disabled, header.checking_disabled, "CD");
    assert_eq!(out[3] & 0x4F, bytes[3] & 0x4F, "Z and the RCODE's low bits");
    let sections = |walk: &Walk| -> [usize; 3] {
        let count = |s| {
            walk.records
                .iter()
                .filter(|r| r.section == s && r.rtype != rtype::OPT)
                .count()
        };
        [
            count(Section::Answer),
            count(Section::Authority),
            count(Section::Additional),
        ]
    };
    let stored_counts = sections(walk);
    let answers = stored_counts[0].min(kept);
    let authorities = stored_counts[1].min(kept - answers);
    assert_eq!(
        sections(served),
        [answers, authorities, kept - answers - authorities],
        "section counts"
    );
    assert_eq!(h.counts.queries, 1);

    // The question: the client's bytes when it asks the reply's question (RFC 4343: names
    // compare without case), else the reply's own.
    let theirs = &walk.questions[0];
    let asked = Walk::read(query.bytes());
    let asked = &asked.questions[0];
    assert_eq!(
        same_question,
        asked.name == theirs.name && (asked.qtype, asked.qclass) == (theirs.qtype, theirs.qclass),
        "the client's question, by hickory"
    );
    let expected_question = if same_question {
        query.question()
    } else {
        &bytes[12..question_end]
    };
    assert_eq!(&out[12..question_end], expected_question, "question bytes");

    // Records: the first `kept`, each as stored but for its TTL.
    let served_records = served.records.iter().filter(|r| r.rtype != rtype::OPT);
    assert_eq!(served_records.clone().count(), kept, "records kept");
    for (index, (served, stored)) in served_records.zip(&records).enumerate() {
        let what = format!("record {index} at {}", stored.start);
        assert_eq!(served.start, stored.start, "{what}: offset");
        assert_eq!(served.name, stored.name, "{what}: owner");
        assert_eq!(
            (served.rtype, served.class),
            (stored.rtype, stored.class),
            "{what}: type, class"
        );
        let ttl = client.ttl;
        let expected = stored
            .ttl
            .saturating_sub(ttl.age)
            .min(ttl.cap)
            .max(ttl.floor);
        assert_eq!(
            served.ttl, expected,
            "{what}: TTL {} with {ttl:?}",
            stored.ttl
        );
        assert_eq!(
            out[served.rdata.clone()],
            bytes[stored.rdata.clone()],
            "{what}: RDATA bytes"
        );
        if let Ok(data) = &stored.data {
            match &served.data {
                Ok(served) => assert_eq!(served, data, "{what}: RDATA as hickory reads it"),
                Err(e) => panic!("{what}: hickory read its RDATA before serving, not after: {e}"),
            }
        }
    }

    // Our OPT, last, only for a client that sent one (and if there is room for it).
    let opts: Vec<_> = served.opts().collect();
    match edns {
        None => assert!(opts.is_empty(), "an OPT for a client without EDNS"),
        Some((_, dnssec_ok)) => {
            let [(index, opt)] = opts[..] else {
                panic!("{} OPT records for a client with EDNS", opts.len());
            };
            assert_eq!(index + 1, served.records.len(), "OPT not last");
            assert_eq!(opt.section, Section::Additional);
            assert_eq!(&out[opt.start..opt.start + 1], [0]);
            assert_eq!(opt.class, nodedns_wire::EDNS_UDP_SIZE, "our UDP size");
            let extended = (reply.info().rcode >> 4) as u32;
            let do_bit = if dnssec_ok { 0x8000 } else { 0 };
            assert_eq!(
                opt.ttl,
                extended << 24 | do_bit,
                "OPT TTL: extended RCODE, version, DO"
            );
            assert!(opt.rdata.is_empty(), "options in our OPT");
        }
    }
}
