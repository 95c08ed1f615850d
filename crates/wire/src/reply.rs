//! Upstream replies: validated and indexed once, then copied and patched for every hit.

use crate::name::{self, NameError};
use crate::octets::{OPT_LEN, get16, get32, header, push_opt, set16, set32};
use crate::query::RR_FIXED_LEN;
use crate::{HEADER_LEN, MAX_MESSAGE_LEN, Query, flags, rtype};

/// An upstream reply ready to be served any number of times.
///
/// Holds the reply's bytes with the OPT record removed (OPT is hop-by-hop: RFC 6891 §6.1.1; the
/// answer to each client gets its own) and the offset of every TTL field, so a hit is a copy plus
/// a few patches, never a decode.
///
/// Both live in one allocation, the message first and the TTL index after it: a reply costs
/// its miss one allocation of its exact size, and its eviction one free.
#[derive(Debug, Clone)]
pub struct Reply {
    /// The message (`..len`), then the TTL index (`len..`): the offset of the 32-bit TTL field
    /// of every record in the answer, authority and additional sections, in message order (OPT
    /// excluded: its TTL field holds flags, not a TTL), each a native-endian `u16`. Each offset is
    /// also where the record's end is found (RDLENGTH follows the TTL), which is all truncation
    /// needs.
    data: Box<[u8]>,
    /// The message's length.
    len: u16,
    /// Offset just past the question: `bytes[12..question_end]` is overwritten with the
    /// client's question on every hit.
    question_end: u16,
    info: Info,
}

/// What the cache needs to know about a reply to decide whether and how long to keep it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Info {
    /// The full RCODE: header bits, plus the OPT's extended bits when the reply had an OPT.
    pub rcode: u16,
    /// TC: the upstream cut the reply short.
    pub truncated: bool,
    /// AD from the upstream's header (kept, so a validating upstream's verdict is passed on).
    pub authentic_data: bool,
    /// ANCOUNT.
    pub answers: u16,
    /// Smallest TTL over all records in all sections (OPT excluded); `None` if there are none.
    /// A TTL with its top bit set counts as 0 (RFC 2181 §8).
    pub min_ttl: Option<u32>,
    /// For negative caching (RFC 2308 §5): the first SOA in the authority section gives
    /// min(its TTL, its MINIMUM field). `None` if the authority section has no SOA.
    pub negative_ttl: Option<u32>,
}

/// Why an upstream reply cannot be used.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum ReplyError {
    #[error("shorter than a DNS header")]
    ShortHeader,
    #[error("QR bit clear: not a response")]
    NotResponse,
    #[error("question count is not 1")]
    QuestionCount,
    #[error("malformed name")]
    BadName,
    #[error("message ends inside a record")]
    Truncated,
    #[error("trailing bytes after the message")]
    TrailingBytes,
    /// More than one OPT, an OPT outside the additional section, an OPT whose owner is not the
    /// root, or an OPT that is not the last record (removing it would move records that later
    /// compression pointers might target).
    #[error("misplaced OPT record")]
    BadOpt,
    #[error("larger than 65535 bytes")]
    TooLarge,
}

/// How the TTLs of a served copy are computed from the stored ones: each becomes
/// `max(min(stored - age, cap), floor)`, the subtraction saturating at 0.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TtlRule {
    /// Seconds the entry has been in the cache: subtracted from every TTL (saturating at 0).
    pub age: u32,
    /// Upper bound for every TTL after the subtraction: the entry's remaining lifetime, so a TTL
    /// the cache clamped shorter is never advertised longer.
    pub cap: u32,
    /// Lower bound, applied last. 0 for fresh answers (a record sent with TTL 0 keeps it); the
    /// stale TTL for stale answers, with `cap` the same, since RFC 8767 §4 gives every record of
    /// a stale answer that TTL (30 s), a record stored with TTL 0 included.
    pub floor: u32,
}

impl TtlRule {
    /// The stored TTLs unchanged (age 0, no cap, no floor).
    pub const STORED: TtlRule = TtlRule::fresh(0, u32::MAX);

    /// A fresh entry's rule: `age` seconds in the cache, `remaining` seconds of lifetime left.
    pub const fn fresh(age: u32, remaining: u32) -> TtlRule {
        TtlRule {
            age,
            cap: remaining,
            floor: 0,
        }
    }

    /// A stale answer's rule: every TTL is `ttl` (RFC 8767 §4).
    pub const fn stale(ttl: u32) -> TtlRule {
        TtlRule {
            age: 0,
            cap: ttl,
            floor: ttl,
        }
    }

    /// The TTL served for a stored one.
    fn apply(&self, stored: u32) -> u32 {
        stored
            .saturating_sub(self.age)
            .min(self.cap)
            .max(self.floor)
    }
}

/// Whether two messages carry the same question, names compared case-insensitively
/// (RFC 4343). Used to accept an upstream reply only for the query that was sent.
///
/// Each message must hold exactly one question with an uncompressed name; anything else
/// compares unequal.
pub fn same_question(a: &[u8], b: &[u8]) -> bool {
    match (question(a), question(b)) {
        (Some(a), Some(b)) => questions_match(a, b),
        _ => false,
    }
}

/// Whether two questions (uncompressed name, type, class) are equal with the name compared
/// without ASCII case (RFC 4343 §3) and type and class compared exactly.
fn questions_match(a: &[u8], b: &[u8]) -> bool {
    // A client almost always asks in the letter case of the query that filled the entry (the
    // upstream echoes it): one `memcmp` settles that, where the case-folding loop below goes
    // byte by byte.
    if a == b {
        return a.len() >= 4;
    }
    let (Some(split_a), Some(split_b)) = (a.len().checked_sub(4), b.len().checked_sub(4)) else {
        return false;
    };
    let (name_a, rest_a) = a.split_at(split_a);
    let (name_b, rest_b) = b.split_at(split_b);
    // Label length bytes are at most 63, below b'A', so a byte-wise ASCII case-insensitive
    // comparison compares the label structure exactly and the label text without case.
    name_a.eq_ignore_ascii_case(name_b) && rest_a == rest_b
}

/// The question's bytes (name, type, class) of a message with QDCOUNT 1.
fn question(msg: &[u8]) -> Option<&[u8]> {
    if get16(msg, header::QDCOUNT)? != 1 {
        return None;
    }
    let name_end = name::skip_uncompressed(msg, HEADER_LEN).ok()?;
    msg.get(HEADER_LEN..name_end.checked_add(4)?)
}

impl Reply {
    /// Validates and indexes an upstream reply: QR set, exactly one question, every name and
    /// record inside the bytes (compression pointers point backwards, loops rejected), at most
    /// one OPT and only as the last record (it is removed and ARCOUNT lowered), and the first
    /// authority SOA's RDATA well-formed (its MINIMUM is read). No name may point into the header
    /// or be read from a TTL field, since both are rewritten when the reply is served (no real
    /// encoder does either): owner names, and the names inside the RDATA of the types whose
    /// RDATA names receivers decompress (CNAME, NS, PTR, MX, SOA, SRV, NAPTR, SVCB, ...; see
    /// [`RdataNames`]), which must also lie within their RDATA. Other RDATA is copied as it is,
    /// not interpreted. Never panics.
    pub fn parse(bytes: &[u8]) -> Result<Self, ReplyError> {
        // Offsets are stored as u16; RFC 1035 §4.2.2 caps a message at 65535 bytes anyway.
        if bytes.len() > usize::from(u16::MAX) {
            return Err(ReplyError::TooLarge);
        }
        let (Some(flags), Some(qdcount), Some(ancount), Some(nscount), Some(arcount)) = (
            get16(bytes, header::FLAGS),
            get16(bytes, header::QDCOUNT),
            get16(bytes, header::ANCOUNT),
            get16(bytes, header::NSCOUNT),
            get16(bytes, header::ARCOUNT),
        ) else {
            return Err(ReplyError::ShortHeader);
        };
        if flags & flags::QR == 0 {
            return Err(ReplyError::NotResponse);
        }
        if qdcount != 1 {
            return Err(ReplyError::QuestionCount);
        }
        let name_end = name::skip_uncompressed(bytes, HEADER_LEN).map_err(|e| match e {
            NameError::Malformed => ReplyError::BadName,
            NameError::Truncated => ReplyError::Truncated,
        })?;
        let question_end = name_end + 4;
        if question_end > bytes.len() {
            return Err(ReplyError::Truncated);
        }

        let total = usize::from(ancount) + usize::from(nscount) + usize::from(arcount);
        // Every record takes at least 11 bytes: do not let a forged count reserve much.
        let mut ttls = Vec::with_capacity(total.min(bytes.len() / 11));
        let mut min_ttl: Option<u32> = None;
        let mut negative_ttl = None;
        let mut opt = None;
        let mut pos = question_end;
        for index in 0..total {
            let record = Record::read(bytes, pos, &ttls)?;
            let section = if index < usize::from(ancount) {
                Section::Answer
            } else if index < usize::from(ancount) + usize::from(nscount) {
                Section::Authority
            } else {
                Section::Additional
            };
            if record.rr_type == rtype::OPT {
                // RFC 6891 §6.1.1: one OPT, in the additional section, with the root as owner
                // (§6.1.2). It must also be last: removing it must not move any other record,
                // since later names or RDATA could point into what follows it.
                let is_last = index + 1 == total;
                if section != Section::Additional || !is_last || record.fixed != pos + 1 {
                    return Err(ReplyError::BadOpt);
                }
                opt = Some((pos, record));
            } else {
                let ttl = sane_ttl(record.ttl);
                min_ttl = Some(min_ttl.map_or(ttl, |min| min.min(ttl)));
                // Indexed before the RDATA is walked: a name in the RDATA may not be read from
                // the record's own TTL field either.
                ttls.push(u16::try_from(record.fixed + 4).map_err(|_| ReplyError::TooLarge)?);
                let names_end = rdata_names(bytes, &record, &ttls)?;
                if section == Section::Authority
                    && record.rr_type == rtype::SOA
                    && negative_ttl.is_none()
                {
                    // RFC 2308 §5: the TTL of a negative answer is min(SOA TTL, SOA MINIMUM).
                    let names_end = names_end.ok_or(ReplyError::Truncated)?;
                    let minimum = soa_minimum(bytes, names_end, record.end)?;
                    negative_ttl = Some(ttl.min(sane_ttl(minimum)));
                }
            }
            pos = record.end;
        }
        if pos != bytes.len() {
            return Err(ReplyError::TrailingBytes);
        }

        let header_rcode = flags & flags::RCODE_MASK;
        // The OPT is not stored (RFC 6891 §6.1.1: "OPT RRs MUST NOT be cached").
        let len = opt.map_or(bytes.len(), |(start, _)| start);
        let mut data = Vec::with_capacity(len + 2 * ttls.len());
        data.extend_from_slice(bytes.get(..len).unwrap_or_default());
        let rcode = match opt {
            Some((_, record)) => {
                set16(&mut data, header::ARCOUNT, arcount.saturating_sub(1));
                // RFC 6891 §6.1.3: EXTENDED-RCODE holds the upper 8 bits of a 12-bit RCODE.
                let extended = (record.ttl >> 24) as u16;
                extended << 4 | header_rcode
            }
            None => header_rcode,
        };
        for at in &ttls {
            data.extend_from_slice(&at.to_ne_bytes());
        }
        Ok(Reply {
            // Of its exact size: no reallocation.
            data: data.into_boxed_slice(),
            len: u16::try_from(len).map_err(|_| ReplyError::TooLarge)?,
            question_end: u16::try_from(question_end).map_err(|_| ReplyError::TooLarge)?,
            info: Info {
                rcode,
                truncated: flags & flags::TC != 0,
                authentic_data: flags & flags::AD != 0,
                answers: ancount,
                min_ttl,
                negative_ttl,
            },
        })
    }

    pub fn info(&self) -> &Info {
        &self.info
    }

    /// The stored bytes (OPT removed).
    pub fn bytes(&self) -> &[u8] {
        self.parts().0
    }

    /// The message, and the TTL index: two bytes, a native-endian offset, per record.
    #[inline(always)]
    fn parts(&self) -> (&[u8], &[u8]) {
        self.data
            .split_at_checked(usize::from(self.len))
            .unwrap_or((&self.data, &[]))
    }

    /// The stored question: bytes from offset 12 to the end of the question (name, type,
    /// class), as upstream sent them.
    pub fn question(&self) -> &[u8] {
        self.bytes()
            .get(HEADER_LEN..usize::from(self.question_end))
            .unwrap_or_default()
    }

    /// Bytes this reply holds on the heap (message plus TTL index), for the cache's weigher.
    pub fn heap_size(&self) -> usize {
        self.data.len()
    }

    /// Writes the answer to `query`, served from the cache, into `out` (cleared first): the
    /// stored bytes with the query's ID, RD bit and question bytes (so the client's name case
    /// comes back as sent), AA set (as CoreDNS's cache sets it on what it serves), every TTL
    /// patched by `ttl`, and an OPT record advertising [`crate::EDNS_UDP_SIZE`] (DO echoed) only
    /// if the query had one.
    ///
    /// If the whole exceeds `limit`, as many whole records as fit are kept, in message order
    /// (answer section, then authority, then additional: a prefix of the message, the records
    /// CoreDNS's `Msg.Truncate` keeps), the section counts lowered to match, and TC set (RFC 1035
    /// §4.2.1, RFC 2181 §9), the OPT still last. A client that retries over TCP gets the whole
    /// answer there (RFC 7766 §5); one that does not (musl before 1.2.4) still has the records
    /// that fit. Never a partial record: if not even the first fits, the header and question
    /// (and OPT) alone, with TC, are written, even beyond `limit` (they are under 300 bytes,
    /// below any real limit).
    ///
    /// Allocates nothing once `out` has grown to the answer's size; a cut answer also reads the
    /// TTL index of the records it keeps, which locates where each record ends.
    ///
    /// `query` must have the same key as the query this reply answers; the question bytes are
    /// copied from it (if they differ beyond letter case, a caller bug, the stored question is
    /// kept, so the answer stays well-formed).
    pub fn write_answer(&self, query: &Query<'_>, ttl: TtlRule, limit: usize, out: &mut Vec<u8>) {
        self.write(query, ttl, limit, flags::AA, out);
    }

    /// Like [`Reply::write_answer`], for the reply just fetched, relayed to the clients that
    /// waited for it: AA stays as the upstream set it. node-cache sets AA only on what its cache
    /// serves; what it relays (every REFUSED, FORMERR, truncated or other uncacheable reply, and
    /// the first answer to a miss) keeps the upstream's bit.
    pub fn write_relayed(&self, query: &Query<'_>, ttl: TtlRule, limit: usize, out: &mut Vec<u8>) {
        self.write(query, ttl, limit, 0, out);
    }

    /// Both of the above: `aa` is OR-ed into the stored flags.
    #[inline(always)]
    fn write(&self, query: &Query<'_>, ttl: TtlRule, limit: usize, aa: u16, out: &mut Vec<u8>) {
        out.clear();
        let mut edns = query.edns();
        let mut opt_len = if edns.is_some() { OPT_LEN } else { 0 };
        let question_end = usize::from(self.question_end);
        let (bytes, index) = self.parts();
        // The client's question replaces ours only if it is the same up to case, as it is when
        // the keys match. Anything else is a caller bug; then our own question is kept, so
        // compression pointers into it stay valid and no offset moves.
        let ours = bytes.get(HEADER_LEN..question_end).unwrap_or_default();
        let client_question = Some(query.question()).filter(|q| questions_match(q, ours));
        let mut full = bytes.len() + opt_len <= limit;
        if !full && opt_len != 0 && limit >= MAX_MESSAGE_LEN && bytes.len() <= limit {
            // A TCP answer (RFC 1035 §4.2.2: 65535 bytes at most) with no room for our OPT: the
            // upstream's reply had none (stripped, its OPT would have left room for ours), so it
            // goes out whole as the upstream sent it, without one. Cut with TC, it would leave
            // the client no transport to retry on.
            (edns, opt_len, full) = (None, 0, true);
        }
        let (kept, body_end) = if full {
            (index.len() / 2, bytes.len())
        } else {
            self.fitting(limit.saturating_sub(opt_len))
        };
        out.reserve(body_end + opt_len);
        out.extend_from_slice(bytes.get(..body_end).unwrap_or_default());

        set16(out, header::ID, query.id());
        let stored_flags = get16(out, header::FLAGS).unwrap_or(0);
        // RD echoed (RFC 1035 §4.1.1); AD, CD, RA and the RCODE stay the upstream's.
        let mut flags = (stored_flags | aa) & !flags::RD;
        if query.rd() {
            flags |= flags::RD;
        }
        if !full {
            // RFC 1035 §4.2.1 / RFC 6891 §7: what does not fit is cut and TC set, so the client
            // can retry over TCP (RFC 7766 §5). The records kept are the first `kept`.
            flags |= flags::TC;
            let ancount = usize::from(self.info.answers).min(kept);
            let nscount =
                usize::from(get16(bytes, header::NSCOUNT).unwrap_or(0)).min(kept - ancount);
            // Each is at most the stored count, a u16.
            let count = |n: usize| u16::try_from(n).unwrap_or(u16::MAX);
            set16(out, header::ANCOUNT, count(ancount));
            set16(out, header::NSCOUNT, count(nscount));
            set16(out, header::ARCOUNT, count(kept - ancount - nscount));
        }
        set16(out, header::FLAGS, flags);
        if let (Some(question), Some(ours)) =
            (client_question, out.get_mut(HEADER_LEN..question_end))
        {
            // 0x20 case randomization: the client checks its name comes back exactly as sent.
            ours.copy_from_slice(question);
        }
        let ttls = index.get(..2 * kept).unwrap_or_default();
        if ttl.floor == 0 {
            // Every fresh answer: the floor would be one more operation per record on the hit
            // path, for nothing.
            patch_ttls(out, ttls, |stored| {
                stored.saturating_sub(ttl.age).min(ttl.cap)
            });
        } else {
            patch_ttls(out, ttls, |stored| ttl.apply(stored));
        }
        if let Some(edns) = edns {
            // RFC 6891 §6.1.1: a request with an OPT gets an OPT back; ours, never the upstream's.
            let extended = (self.info.rcode >> 4) as u8;
            push_opt(out, extended, edns.dnssec_ok);
            let arcount = get16(out, header::ARCOUNT).unwrap_or(0);
            set16(out, header::ARCOUNT, arcount.saturating_add(1));
        }
    }

    /// How many records, from the first, end within `budget` bytes, and where the last of them
    /// ends (the end of the question when none does). Records are contiguous and in order, so
    /// their ends rise with their TTL offsets: the records that fit are the first ones, read up
    /// to the first that does not (no more than the copy of the kept records costs).
    fn fitting(&self, budget: usize) -> (usize, usize) {
        let (bytes, index) = self.parts();
        // The end of the record whose TTL field is at `at`: the TTL, RDLENGTH, then RDATA
        // (RFC 1035 §4.1.3).
        let record_end = |at: usize| Some(at + 6 + usize::from(get16(bytes, at + 4)?));
        let (mut kept, mut end) = (0, usize::from(self.question_end));
        for at in offsets(index) {
            match record_end(at) {
                Some(record) if record <= budget => (kept, end) = (kept + 1, record),
                _ => break,
            }
        }
        (kept, end)
    }
}

/// The offsets a TTL index holds, in order.
#[inline(always)]
fn offsets(index: &[u8]) -> impl Iterator<Item = usize> + '_ {
    index
        .chunks_exact(2)
        .map(|at| usize::from(u16::from_ne_bytes([at[0], at[1]])))
}

/// Rewrites the TTL field at each offset of the TTL index `ttls` in `out` with `rule` of its
/// stored value.
#[inline(always)]
fn patch_ttls(out: &mut [u8], ttls: &[u8], rule: impl Fn(u32) -> u32) {
    for at in offsets(ttls) {
        if let Some(stored) = get32(out, at) {
            set32(out, at, rule(stored));
        }
    }
}

/// The sections records are read from (RFC 1035 §4.1).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Section {
    Answer,
    Authority,
    Additional,
}

/// A resource record located in a message (RFC 1035 §4.1.3).
#[derive(Debug, Clone, Copy)]
struct Record {
    /// Offset of the TYPE field, just past the owner name.
    fixed: usize,
    rr_type: u16,
    ttl: u32,
    /// Offset of the RDATA.
    rdata: usize,
    /// Offset just past the RDATA.
    end: usize,
}

impl Record {
    /// Reads the record at `pos`. Its owner name must not be read, through a pointer, from any
    /// of the TTL fields at `ttls` (they change on every answer served).
    fn read(msg: &[u8], pos: usize, ttls: &[u16]) -> Result<Record, ReplyError> {
        let fixed = name::skip_avoiding(msg, pos, ttls).map_err(|e| match e {
            NameError::Malformed => ReplyError::BadName,
            NameError::Truncated => ReplyError::Truncated,
        })?;
        let (Some(rr_type), Some(ttl), Some(rdlen)) = (
            get16(msg, fixed),
            get32(msg, fixed + 4),
            get16(msg, fixed + 8),
        ) else {
            return Err(ReplyError::Truncated);
        };
        let rdata = fixed + RR_FIXED_LEN;
        let end = rdata + usize::from(rdlen);
        if end > msg.len() {
            return Err(ReplyError::Truncated);
        }
        Ok(Record {
            fixed,
            rr_type,
            ttl,
            rdata,
            end,
        })
    }
}

/// Where the RDATA of a record type holds domain names that receivers decompress, so that a
/// compression pointer in them is followed: RFC 3597 §4 (the types of RFC 1035 MUST be
/// decompressed; RP, AFSDB, RT, SIG, PX, NXT, NAPTR and SRV SHOULD be), and the names common
/// decoders (hickory-proto's among them) read the same way: DNAME's target (RFC 6672), SVCB's
/// and HTTPS's TargetName (RFC 9460), TSIG's algorithm name (RFC 8945), ANAME's target.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum RdataNames {
    /// `count` names, after `skip` bytes of fixed fields.
    After { skip: u8, count: u8 },
    /// NAPTR (RFC 3403 §4.1): ORDER and PREFERENCE, three character-strings (FLAGS, SERVICES,
    /// REGEXP), then REPLACEMENT.
    Naptr,
}

impl RdataNames {
    fn of(rr_type: u16) -> Option<RdataNames> {
        let after = |skip, count| Some(RdataNames::After { skip, count });
        match rr_type {
            // NS, MD, MF, CNAME, MB, MG, MR, PTR, NXT, DNAME, TSIG, ANAME.
            2 | 3 | 4 | 5 | 7 | 8 | 9 | 12 | 30 | 39 | 250 | 65305 => after(0, 1),
            // SOA (MNAME, RNAME), MINFO (RMAILBX, EMAILBX), RP (mbox, txt).
            6 | 14 | 17 => after(0, 2),
            // MX, AFSDB, RT, SVCB, HTTPS: a 16-bit preference or priority first.
            15 | 18 | 21 | 64 | 65 => after(2, 1),
            // PX: PREFERENCE, MAP822, MAPX400.
            26 => after(2, 2),
            // SIG: 18 bytes of fields, then the signer's name.
            24 => after(18, 1),
            // SRV: priority, weight, port, then the target.
            33 => after(6, 1),
            35 => Some(RdataNames::Naptr),
            _ => None,
        }
    }
}

/// Walks the domain names in `record`'s RDATA, if its type has any (see [`RdataNames`]): each
/// must lie within the RDATA and, like an owner name, not be read from the header or from a TTL
/// field at `ttls` (the record's own included), since serving rewrites both and the name a client
/// decompresses would change with them. Returns where the last name ends.
fn rdata_names(msg: &[u8], record: &Record, ttls: &[u16]) -> Result<Option<usize>, ReplyError> {
    let Some(names) = RdataNames::of(record.rr_type) else {
        return Ok(None);
    };
    // Names inside RDATA may point anywhere before them, but must not run past the RDATA.
    let rdata = msg.get(..record.end).ok_or(ReplyError::Truncated)?;
    let walk = |at: usize| {
        name::skip_avoiding(rdata, at, ttls).map_err(|e| match e {
            NameError::Malformed => ReplyError::BadName,
            NameError::Truncated => ReplyError::Truncated,
        })
    };
    let (mut at, count) = match names {
        RdataNames::After { skip, count } => (record.rdata + usize::from(skip), count),
        RdataNames::Naptr => {
            let mut at = record.rdata + 4;
            for _ in 0..3 {
                // A character-string: a length byte and that many bytes (RFC 1035 §3.3).
                let len = rdata.get(at).ok_or(ReplyError::Truncated)?;
                at += 1 + usize::from(*len);
            }
            (at, 1)
        }
    };
    for _ in 0..count {
        at = walk(at)?;
    }
    Ok(Some(at))
}

/// The MINIMUM field of a SOA record (RFC 1035 §3.3.13: MNAME, RNAME, then five 32-bit fields,
/// MINIMUM last), given where its names end. RDATA whose names and fields do not add up to its
/// length is rejected rather than read at a wrong offset.
fn soa_minimum(msg: &[u8], names_end: usize, end: usize) -> Result<u32, ReplyError> {
    if names_end + 20 != end {
        return Err(ReplyError::Truncated);
    }
    get32(msg, names_end + 16).ok_or(ReplyError::Truncated)
}

/// RFC 2181 §8: a TTL with the most significant bit set is treated as zero.
fn sane_ttl(ttl: u32) -> u32 {
    if ttl > i32::MAX as u32 { 0 } else { ttl }
}

#[cfg(test)]
mod tests {
    use std::net::{Ipv4Addr, Ipv6Addr};

    use hickory_proto::op::{Message, ResponseCode};
    use hickory_proto::rr::rdata::{A, AAAA, CNAME, SOA};
    use hickory_proto::rr::{RData, Record as HickoryRecord, RecordType};

    use super::*;
    use crate::testutil::{decode, edns, encode, name, query_message, response_to};

    const FOREVER: TtlRule = TtlRule::STORED;

    fn a(owner: &str, ttl: u32, last: u8) -> HickoryRecord {
        HickoryRecord::from_rdata(name(owner), ttl, RData::A(A(Ipv4Addr::new(10, 0, 0, last))))
    }

    fn soa(owner: &str, ttl: u32, minimum: u32) -> HickoryRecord {
        let rdata = SOA::new(
            name("ns.dns.cluster.local."),
            name("hostmaster.cluster.local."),
            1,
            7200,
            1800,
            86400,
            minimum,
        );
        HickoryRecord::from_rdata(name(owner), ttl, RData::SOA(rdata))
    }

    /// A reply with two A answers (TTLs 300 and 60) to a query for `example.com. A`, with an OPT.
    fn positive() -> (Message, Message) {
        let query = query_message(0x1111, "example.com.", RecordType::A, Some((1232, false)));
        let mut reply = response_to(&query);
        reply.add_answer(a("example.com.", 300, 1));
        reply.add_answer(a("example.com.", 60, 2));
        reply.set_edns(edns(1232, false));
        (query, reply)
    }

    fn parse(msg: &Message) -> Reply {
        Reply::parse(&encode(msg)).unwrap()
    }

    fn answer(reply: &Reply, query: &[u8], ttl: TtlRule, limit: usize) -> Message {
        let query = Query::parse(query).unwrap();
        let mut out = Vec::new();
        reply.write_answer(&query, ttl, limit, &mut out);
        decode(&out)
    }

    #[test]
    fn parse_strips_the_opt_and_lowers_arcount() {
        let (_, mut msg) = positive();
        msg.add_additional(a("ns.example.com.", 10, 3));
        let reply = parse(&msg);
        let stored = decode(reply.bytes());
        assert!(stored.edns.is_none());
        assert_eq!(stored.additionals.len(), 1);
        assert_eq!(stored.answers, msg.answers);
        assert_eq!(reply.bytes().len(), encode(&msg).len() - 11);
        assert_eq!(reply.heap_size(), reply.bytes().len() + 3 * 2);
    }

    #[test]
    fn parse_fills_info() {
        let (_, mut msg) = positive();
        msg.metadata.authentic_data = true;
        msg.add_additional(a("ns.example.com.", 10, 3));
        let info = *parse(&msg).info();
        assert_eq!(
            info,
            Info {
                rcode: 0,
                truncated: false,
                authentic_data: true,
                answers: 2,
                min_ttl: Some(10),
                negative_ttl: None,
            }
        );
    }

    #[test]
    fn reply_without_records_has_no_min_ttl() {
        let (_, mut msg) = positive();
        msg.answers.clear();
        msg.metadata.truncation = true;
        let info = *parse(&msg).info();
        assert_eq!(info.min_ttl, None);
        assert_eq!(info.answers, 0);
        assert!(info.truncated);
    }

    #[test]
    fn negative_ttl_is_min_of_soa_ttl_and_minimum() {
        let query = query_message(1, "nope.cluster.local.", RecordType::A, None);
        let mut msg = response_to(&query);
        msg.metadata.response_code = ResponseCode::NXDomain;
        msg.add_authority(soa("cluster.local.", 30, 5));
        let info = *parse(&msg).info();
        assert_eq!(info.rcode, u16::from(crate::rcode::NXDOMAIN));
        assert_eq!(info.negative_ttl, Some(5));
        assert_eq!(info.min_ttl, Some(30));

        msg.authorities = vec![soa("cluster.local.", 10, 60), soa("local.", 1, 1)];
        assert_eq!(
            parse(&msg).info().negative_ttl,
            Some(10),
            "the first SOA counts"
        );
    }

    #[test]
    fn soa_name_read_from_its_own_ttl_is_refused() {
        // NXDOMAIN for `example.com. SOA`; the authority SOA's MNAME is a pointer to its own TTL
        // field, whose bytes (0x01 'x' 0x00 0x00) read as `x.`: once the TTL is patched the
        // name would be another, or none. Found by the differential fuzz target.
        let mut bytes = b"\x00\x01\x81\x83\x00\x01\x00\x00\x00\x01\x00\x00".to_vec();
        bytes.extend_from_slice(b"\x07example\x03com\x00\x00\x06\x00\x01");
        let ttl_at = bytes.len() + 6;
        bytes.extend_from_slice(b"\xc0\x0c\x00\x06\x00\x01\x01x\x00\x00\x00\x17");
        bytes.extend_from_slice(&(0xc000 | ttl_at as u16).to_be_bytes());
        bytes.extend_from_slice(b"\x00\0\0\0\x01\0\0\0\x02\0\0\0\x03\0\0\0\x04\0\0\0\x05");
        assert_eq!(Reply::parse(&bytes).unwrap_err(), ReplyError::BadName);
        // The same SOA with an MNAME of its own parses.
        let mut fixed = bytes[..bytes.len() - 23].to_vec();
        fixed[ttl_at + 5] = 26;
        fixed.extend_from_slice(
            b"\x02ns\xc0\x0c\x00\0\0\0\x01\0\0\0\x02\0\0\0\x03\0\0\0\x04\0\0\0\x05",
        );
        assert_eq!(Reply::parse(&fixed).unwrap().info().negative_ttl, Some(5));
    }

    /// A NOERROR reply for `example.com. A` (its name at offset 12) with the given answers, each
    /// owned by a pointer to the question: (type, TTL, RDATA).
    fn raw_reply(answers: &[(u16, u32, &[u8])]) -> Vec<u8> {
        let mut bytes = b"\x00\x01\x81\x80\x00\x01\x00\x00\x00\x00\x00\x00".to_vec();
        bytes[7] = answers.len() as u8;
        bytes.extend_from_slice(b"\x07example\x03com\x00\x00\x01\x00\x01");
        for (rr_type, ttl, rdata) in answers {
            bytes.extend_from_slice(b"\xc0\x0c");
            bytes.extend_from_slice(&rr_type.to_be_bytes());
            bytes.extend_from_slice(&[0, 1]);
            bytes.extend_from_slice(&ttl.to_be_bytes());
            bytes.extend_from_slice(&(rdata.len() as u16).to_be_bytes());
            bytes.extend_from_slice(rdata);
        }
        bytes
    }

    /// Offset of the first answer's TTL field in a [`raw_reply`].
    const FIRST_TTL: u16 = 12 + 17 + 6;

    #[test]
    fn rdata_name_read_from_a_ttl_field_is_refused() {
        // A CNAME whose target is a pointer to its own TTL (0x01 'y' 0x00 0x00: `y.`), then one
        // whose target is the first record's TTL: serving would change both targets. Found by
        // the differential fuzz target.
        let own = (0xc000 | FIRST_TTL).to_be_bytes();
        let bytes = raw_reply(&[(rtype::CNAME, 0x0179_0000, &own)]);
        assert_eq!(Reply::parse(&bytes).unwrap_err(), ReplyError::BadName);
        let earlier = raw_reply(&[(rtype::A, 0x0179_0000, b"\x0a\0\0\x01"), (5, 60, &own)]);
        assert_eq!(Reply::parse(&earlier).unwrap_err(), ReplyError::BadName);
        // The same pointers in the RDATA of a type whose RDATA holds no name are only bytes.
        let opaque = raw_reply(&[(rtype::TXT, 0x0179_0000, &own)]);
        assert!(Reply::parse(&opaque).is_ok());
        let unknown = raw_reply(&[(65280, 0x0179_0000, &own)]);
        assert!(Reply::parse(&unknown).is_ok());
    }

    #[test]
    fn rdata_name_pointing_into_the_header_is_refused() {
        // An MX whose exchange points at offset 4 (QDCOUNT's first byte, 0: the root).
        let bytes = raw_reply(&[(15, 60, b"\x00\x0a\xc0\x04")]);
        assert_eq!(Reply::parse(&bytes).unwrap_err(), ReplyError::BadName);
        let bytes = raw_reply(&[(15, 60, b"\x00\x0a\xc0\x0c")]);
        assert!(Reply::parse(&bytes).is_ok());
    }

    #[test]
    fn rdata_names_are_found_after_each_types_fixed_fields() {
        // Compressed names where each type has them, pointing at the question: accepted.
        let srv = b"\x00\x01\x00\x02\x00\x35\x03sip\xc0\x0c";
        let naptr = b"\x00\x0a\x00\x14\x01U\x07E2U+sip\x00\xc0\x0c";
        let svcb = b"\x00\x01\xc0\x0c\x00\x01\x00\x03\x02h2";
        let soa_in_answer = b"\xc0\x0c\xc0\x0c\0\0\0\x01\0\0\0\x02\0\0\0\x03\0\0\0\x04\0\0\0\x05";
        for (rr_type, rdata) in [
            (rtype::SRV, &srv[..]),
            (35, &naptr[..]),
            (64, &svcb[..]),
            (rtype::SOA, &soa_in_answer[..]),
            (rtype::PTR, b"\x01x\xc0\x0c"),
        ] {
            let bytes = raw_reply(&[(rr_type, 60, rdata)]);
            assert!(Reply::parse(&bytes).is_ok(), "type {rr_type}");
        }
        // The same with the name's pointer moved onto the TTL: refused, which shows where each
        // type's name was looked for.
        let ttl = (0xc000 | FIRST_TTL).to_be_bytes();
        for (rr_type, fixed) in [
            (rtype::SRV, &srv[..6]),
            (35, &naptr[..15]),
            (64, &svcb[..2]),
            (rtype::SOA, &b""[..]),
            (rtype::PTR, &b""[..]),
        ] {
            let mut rdata = fixed.to_vec();
            rdata.extend_from_slice(&ttl);
            let bytes = raw_reply(&[(rr_type, 0x0179_0000, &rdata)]);
            assert_eq!(
                Reply::parse(&bytes).unwrap_err(),
                ReplyError::BadName,
                "type {rr_type}"
            );
        }
    }

    #[test]
    fn rdata_names_must_lie_within_their_rdata() {
        // SRV RDATA shorter than its fixed fields, and one whose target runs into the next record.
        let short = raw_reply(&[(rtype::SRV, 60, b"\x00\x01\x00")]);
        assert_eq!(Reply::parse(&short).unwrap_err(), ReplyError::Truncated);
        let runs_on = raw_reply(&[
            (rtype::SRV, 60, b"\x00\x01\x00\x02\x00\x35\x03sip"),
            (rtype::A, 60, b"\x0a\0\0\x01"),
        ]);
        assert_eq!(Reply::parse(&runs_on).unwrap_err(), ReplyError::Truncated);
        // NAPTR character-strings running past the RDATA.
        let naptr = raw_reply(&[(35, 60, b"\x00\x0a\x00\x14\x01U\x09E2U")]);
        assert_eq!(Reply::parse(&naptr).unwrap_err(), ReplyError::Truncated);
    }

    #[test]
    fn soa_outside_the_authority_section_gives_no_negative_ttl() {
        let query = query_message(1, "cluster.local.", RecordType::SOA, None);
        let mut msg = response_to(&query);
        msg.add_answer(soa("cluster.local.", 30, 5));
        assert_eq!(parse(&msg).info().negative_ttl, None);
    }

    #[test]
    fn ttl_with_top_bit_counts_as_zero_in_info() {
        let (_, mut msg) = positive();
        msg.answers[0].ttl = 0x8000_0000;
        assert_eq!(parse(&msg).info().min_ttl, Some(0));
    }

    #[test]
    fn extended_rcode_combines_opt_and_header_bits() {
        let (_, mut msg) = positive();
        msg.metadata.response_code = ResponseCode::BADCOOKIE;
        let bytes = encode(&msg);
        assert_eq!(bytes[3] & 0xF, 23 & 0xF);
        assert_eq!(parse(&msg).info().rcode, 23);
    }

    /// The bytes of a message with `extra` appended as more additional records.
    fn with_extra_additional(msg: &Message, extra: &[&[u8]]) -> Vec<u8> {
        let mut bytes = encode(msg);
        let arcount = u16::from_be_bytes([bytes[10], bytes[11]]) + extra.len() as u16;
        bytes[10..12].copy_from_slice(&arcount.to_be_bytes());
        for rr in extra {
            bytes.extend_from_slice(rr);
        }
        bytes
    }

    /// An A record owned by the question's name (pointer to offset 12).
    const A_RECORD: &[u8] = b"\xc0\x0c\x00\x01\x00\x01\x00\x00\x00\x3c\x00\x04\x0a\x00\x00\x09";
    const OPT_RECORD: &[u8] = b"\x00\x00\x29\x04\xd0\x00\x00\x00\x00\x00\x00";

    #[test]
    fn opt_not_last_is_bad_opt() {
        let (_, msg) = positive();
        let bytes = with_extra_additional(&msg, &[A_RECORD]);
        assert_eq!(Reply::parse(&bytes).unwrap_err(), ReplyError::BadOpt);
    }

    #[test]
    fn two_opts_are_bad_opt() {
        let (_, msg) = positive();
        let bytes = with_extra_additional(&msg, &[OPT_RECORD]);
        assert_eq!(Reply::parse(&bytes).unwrap_err(), ReplyError::BadOpt);
    }

    #[test]
    fn opt_in_the_answer_section_is_bad_opt() {
        let (_, mut msg) = positive();
        msg.answers.clear();
        msg.edns = None;
        let mut bytes = encode(&msg);
        bytes[7] = 1; // ANCOUNT
        bytes.extend_from_slice(OPT_RECORD);
        assert_eq!(Reply::parse(&bytes).unwrap_err(), ReplyError::BadOpt);
    }

    #[test]
    fn opt_with_a_non_root_owner_is_bad_opt() {
        let (_, mut msg) = positive();
        msg.edns = None;
        let mut opt = b"\xc0\x0c".to_vec();
        opt.extend_from_slice(&OPT_RECORD[1..]);
        let bytes = with_extra_additional(&msg, &[&opt]);
        assert_eq!(Reply::parse(&bytes).unwrap_err(), ReplyError::BadOpt);
    }

    #[test]
    fn header_errors() {
        let (query, msg) = positive();
        let bytes = encode(&msg);
        assert_eq!(
            Reply::parse(&bytes[..11]).unwrap_err(),
            ReplyError::ShortHeader
        );
        assert_eq!(
            Reply::parse(&encode(&query)).unwrap_err(),
            ReplyError::NotResponse
        );
        let mut two = bytes.clone();
        two[5] = 2;
        assert_eq!(Reply::parse(&two).unwrap_err(), ReplyError::QuestionCount);
        let mut big = bytes.clone();
        big.resize(65536, 0);
        assert_eq!(Reply::parse(&big).unwrap_err(), ReplyError::TooLarge);
    }

    #[test]
    fn every_cut_of_a_reply_is_rejected() {
        let (_, msg) = positive();
        let bytes = encode(&msg);
        for len in HEADER_LEN..bytes.len() {
            let err = Reply::parse(&bytes[..len]).unwrap_err();
            assert_eq!(err, ReplyError::Truncated, "cut at {len}");
        }
    }

    #[test]
    fn trailing_bytes_rejected() {
        let (_, msg) = positive();
        let mut bytes = encode(&msg);
        bytes.push(0);
        assert_eq!(Reply::parse(&bytes).unwrap_err(), ReplyError::TrailingBytes);
    }

    #[test]
    fn forward_pointer_in_a_record_is_bad_name() {
        let (_, mut msg) = positive();
        msg.edns = None;
        let mut rr = A_RECORD.to_vec();
        rr[1] = 0xF0;
        let bytes = with_extra_additional(&msg, &[&rr]);
        assert_eq!(Reply::parse(&bytes).unwrap_err(), ReplyError::BadName);
    }

    #[test]
    fn pointer_loop_in_a_record_is_bad_name() {
        let (_, mut msg) = positive();
        msg.edns = None;
        let start = encode(&msg).len() as u16;
        // A name whose first label is followed by a pointer back to that label.
        let mut rr = vec![1, b'x', 0xC0 | (start >> 8) as u8, start as u8];
        rr.extend_from_slice(&A_RECORD[2..]);
        let bytes = with_extra_additional(&msg, &[&rr]);
        assert_eq!(Reply::parse(&bytes).unwrap_err(), ReplyError::BadName);
    }

    #[test]
    fn owner_name_read_from_a_ttl_field_is_bad_name() {
        // The first answer's TTL is 0x0261_6200: as a name, the label "ab" then the root. A later
        // owner pointing there would change name as the TTL is patched.
        let (_, mut msg) = positive();
        msg.edns = None;
        msg.answers.truncate(1);
        msg.answers[0].ttl = 0x0261_6200;
        let bytes = encode(&msg);
        let question_end = name::skip_uncompressed(&bytes, HEADER_LEN).unwrap() + 4;
        let ttl_at = Record::read(&bytes, question_end, &[]).unwrap().fixed + 4;
        let mut rr = vec![0xC0, ttl_at as u8];
        rr.extend_from_slice(&A_RECORD[2..]);
        let bytes = with_extra_additional(&msg, &[&rr]);
        // The name itself is well-formed; only where it is read from is wrong.
        let rr_at = bytes.len() - rr.len();
        assert_eq!(name::skip(&bytes, rr_at), Ok(rr_at + 2));
        assert_eq!(Reply::parse(&bytes).unwrap_err(), ReplyError::BadName);
    }

    #[test]
    fn owner_name_running_into_its_own_record_is_bad_name() {
        // Found by fuzzing: the first answer's owner points at the question's QTYPE, from where
        // a 44-byte "label" runs over the answer's own TTL and on. Patching that TTL would make
        // the served copy unreadable.
        let bytes = b"\x00\x02\x85\x00\x00\x01\x00\x03\x00\x00\x00\x01\x03\x77\x77\x77\x07\x64\x65\x66\x61\x75\x6c\x74\x03\x73\x76\x63\x07\x63\x6c\x75\x73\x74\x65\x72\x05\x6c\x6f\x63\x61\x6c\x00\x00\x01\x00\x01\xc0\x2c\x00\x05\x00\x01\x00\x00\x00\x1e\x00\x06\x01\x00\x00\x00\xc0\x10\xc0\x3b\x00\x01\x00\x01\x00\x00\x00\x05\x00\x04\x0a\x00\x00\x07\xc0\x2b\x00\x01\x00\x01\x00\x00\x00\x05\x00\x04\x0a\x00\x00\x08\x00\x00\x29\x04\xd0\x00\x00\x00\x00\x00\x00";
        assert_eq!(Reply::parse(bytes).unwrap_err(), ReplyError::BadName);
    }

    #[test]
    fn owner_name_pointing_into_the_header_is_bad_name() {
        let (_, mut msg) = positive();
        msg.edns = None;
        let mut rr = A_RECORD.to_vec();
        rr[1] = 0x0B; // ARCOUNT's low byte.
        let bytes = with_extra_additional(&msg, &[&rr]);
        assert_eq!(Reply::parse(&bytes).unwrap_err(), ReplyError::BadName);
    }

    #[test]
    fn soa_whose_rdata_does_not_add_up_is_rejected() {
        let query = query_message(1, "nope.cluster.local.", RecordType::A, None);
        let mut msg = response_to(&query);
        msg.add_authority(soa("cluster.local.", 30, 5));
        let bytes = encode(&msg);
        let question_end = name::skip_uncompressed(&bytes, HEADER_LEN).unwrap() + 4;
        let record = Record::read(&bytes, question_end, &[]).unwrap();
        let rdlen = (record.end - record.rdata) as u16;
        // One byte more RDATA than the SOA fields take.
        let mut longer = bytes.clone();
        longer[record.fixed + 8..record.fixed + 10].copy_from_slice(&(rdlen + 1).to_be_bytes());
        longer.push(0);
        assert_eq!(Reply::parse(&longer).unwrap_err(), ReplyError::Truncated);
        // One byte less: MINIMUM would run past the RDATA.
        let mut shorter = bytes.clone();
        shorter[record.fixed + 8..record.fixed + 10].copy_from_slice(&(rdlen - 1).to_be_bytes());
        shorter.pop();
        assert_eq!(Reply::parse(&shorter).unwrap_err(), ReplyError::Truncated);
    }

    #[test]
    fn write_answer_patches_id_rd_aa_and_ttls() {
        let (_, msg) = positive();
        let reply = parse(&msg);
        let mut query = query_message(0x2222, "example.com.", RecordType::A, None);
        query.metadata.recursion_desired = false;
        let out = answer(&reply, &encode(&query), TtlRule::fresh(50, 200), 512);
        assert_eq!(out.metadata.id, 0x2222);
        assert!(!out.metadata.recursion_desired);
        assert!(out.metadata.authoritative);
        assert!(out.metadata.recursion_available);
        assert!(!out.metadata.truncation);
        let ttls: Vec<u32> = out.answers.iter().map(|r| r.ttl).collect();
        assert_eq!(ttls, [200, 10]);
        assert_eq!(out.answers[0].data, msg.answers[0].data);
    }

    #[test]
    fn ttls_saturate_at_zero() {
        let (_, msg) = positive();
        let reply = parse(&msg);
        let query = encode(&query_message(2, "example.com.", RecordType::A, None));
        let out = answer(&reply, &query, TtlRule::fresh(100, u32::MAX), 512);
        let ttls: Vec<u32> = out.answers.iter().map(|r| r.ttl).collect();
        assert_eq!(ttls, [200, 0]);
        let out = answer(&reply, &query, TtlRule::fresh(u32::MAX, u32::MAX), 512);
        assert!(out.answers.iter().all(|r| r.ttl == 0));
    }

    #[test]
    fn negative_answers_soa_ttl_is_patched() {
        let query = query_message(1, "nope.cluster.local.", RecordType::A, None);
        let mut msg = response_to(&query);
        msg.metadata.response_code = ResponseCode::NXDomain;
        msg.add_authority(soa("cluster.local.", 30, 5));
        let reply = parse(&msg);
        let out = answer(&reply, &encode(&query), TtlRule::fresh(3, 5), 512);
        assert_eq!(out.metadata.response_code, ResponseCode::NXDomain);
        assert_eq!(out.authorities[0].ttl, 5);
        let out = answer(&reply, &encode(&query), TtlRule::fresh(28, 5), 512);
        assert_eq!(out.authorities[0].ttl, 2);
    }

    #[test]
    fn question_case_is_echoed() {
        let (_, msg) = positive();
        let reply = parse(&msg);
        let query = encode(&query_message(3, "eXaMpLe.CoM.", RecordType::A, None));
        let mut out = Vec::new();
        reply.write_answer(&Query::parse(&query).unwrap(), FOREVER, 512, &mut out);
        let question = Query::parse(&query).unwrap().question();
        assert_eq!(&out[HEADER_LEN..HEADER_LEN + question.len()], question);
        assert!(questions_match(reply.question(), question));
        assert_ne!(reply.question(), question);
        assert!(same_question(&out, &query));
    }

    #[test]
    fn opt_added_only_when_the_query_had_one() {
        let (_, msg) = positive();
        let reply = parse(&msg);
        let plain = encode(&query_message(4, "example.com.", RecordType::A, None));
        let out = answer(&reply, &plain, FOREVER, 512);
        assert!(out.edns.is_none());
        assert_eq!(out.additionals.len(), 0);

        let with_opt = encode(&query_message(
            4,
            "example.com.",
            RecordType::A,
            Some((4096, false)),
        ));
        let out = answer(&reply, &with_opt, FOREVER, 1232);
        let opt = out.edns.as_ref().unwrap();
        assert_eq!(opt.max_payload(), crate::EDNS_UDP_SIZE);
        assert_eq!(opt.version(), 0);
        assert!(!opt.flags().dnssec_ok);
        assert_eq!(out.answers.len(), 2);
    }

    #[test]
    fn do_bit_is_echoed() {
        let (_, msg) = positive();
        let reply = parse(&msg);
        let query = encode(&query_message(
            5,
            "example.com.",
            RecordType::A,
            Some((1232, true)),
        ));
        let out = answer(&reply, &query, FOREVER, 1232);
        assert!(out.edns.unwrap().flags().dnssec_ok);
    }

    #[test]
    fn upstream_ad_and_rcode_are_kept() {
        let (_, mut msg) = positive();
        msg.metadata.authentic_data = true;
        msg.metadata.response_code = ResponseCode::ServFail;
        let reply = parse(&msg);
        let query = encode(&query_message(
            6,
            "example.com.",
            RecordType::A,
            Some((1232, false)),
        ));
        let out = answer(&reply, &query, FOREVER, 1232);
        assert!(out.metadata.authentic_data);
        assert_eq!(out.metadata.response_code, ResponseCode::ServFail);
    }

    #[test]
    fn extended_rcode_is_carried_in_our_opt() {
        let (_, mut msg) = positive();
        msg.metadata.response_code = ResponseCode::BADCOOKIE;
        let reply = parse(&msg);
        let query = encode(&query_message(
            6,
            "example.com.",
            RecordType::A,
            Some((1232, false)),
        ));
        let out = answer(&reply, &query, FOREVER, 1232);
        assert_eq!(out.metadata.response_code, ResponseCode::BADCOOKIE);
    }

    /// A reply with `count` AAAA answers (28 bytes each with a compressed owner).
    fn big(count: u8) -> (Message, Reply) {
        let query = query_message(7, "big.example.com.", RecordType::AAAA, None);
        let mut msg = response_to(&query);
        for i in 0..count {
            let ip = Ipv6Addr::new(0xfd00, 0, 0, 0, 0, 0, 0, u16::from(i));
            let rr = HickoryRecord::from_rdata(name("big.example.com."), 60, RData::AAAA(AAAA(ip)));
            msg.add_answer(rr);
        }
        let reply = parse(&msg);
        (msg, reply)
    }

    /// A query for `big.example.com. AAAA`, with an OPT advertising `udp` if given.
    fn big_query(udp: Option<u16>) -> Vec<u8> {
        encode(&query_message(
            8,
            "big.example.com.",
            RecordType::AAAA,
            udp.map(|size| (size, false)),
        ))
    }

    /// What `reply` answers to `query` within `limit`, as bytes.
    fn served(reply: &Reply, query: &[u8], ttl: TtlRule, limit: usize) -> Vec<u8> {
        let mut out = Vec::new();
        reply.write_answer(&Query::parse(query).unwrap(), ttl, limit, &mut out);
        out
    }

    #[test]
    fn cut_to_the_whole_records_that_fit_in_512_without_edns() {
        // 33 bytes of header and question, then 28 per record: 17 fit in 512 (509 bytes).
        let (msg, reply) = big(20);
        let query = big_query(None);
        let q = Query::parse(&query).unwrap();
        let out = served(&reply, &query, TtlRule::fresh(10, 30), q.udp_limit());
        assert_eq!(out.len(), 33 + 17 * 28);
        let cut = decode(&out);
        assert!(cut.metadata.truncation);
        assert!(cut.metadata.authoritative);
        assert_eq!(cut.metadata.id, 8);
        assert_eq!(cut.answers.len(), 17);
        for (served, sent) in cut.answers.iter().zip(&msg.answers) {
            assert_eq!(served.data, sent.data);
            assert_eq!(served.ttl, 30, "TTLs patched in what is kept");
        }
        assert!(cut.edns.is_none());
        // Over TCP the same reply is whole.
        let full = decode(&served(&reply, &query, FOREVER, 65535));
        assert!(!full.metadata.truncation);
        assert_eq!(full.answers.len(), 20);
    }

    #[test]
    fn cut_to_the_clients_size_with_edns_and_the_opt_kept() {
        let (_, reply) = big(30); // 33 + 30 * 28 = 873 bytes, + 11 for the OPT.
        // 800 = 33 + 27 * 28 + 11 exactly: 27 records, and the OPT, last.
        let out = served(&reply, &big_query(Some(800)), FOREVER, 800);
        assert_eq!(out.len(), 800);
        let cut = decode(&out);
        assert!(cut.metadata.truncation);
        assert_eq!(cut.answers.len(), 27);
        assert!(cut.additionals.is_empty());
        assert_eq!(
            cut.edns.as_ref().unwrap().max_payload(),
            crate::EDNS_UDP_SIZE
        );
        // One byte less: one record less.
        let out = served(&reply, &big_query(Some(800)), FOREVER, 799);
        assert_eq!(out.len(), 800 - 28);
        assert_eq!(decode(&out).answers.len(), 26);
        // 1232 holds the whole; exactly at the limit is not cut, one byte under is.
        let fits = decode(&served(&reply, &big_query(Some(1232)), FOREVER, 1232));
        assert!(!fits.metadata.truncation);
        assert_eq!(fits.answers.len(), 30);
        let exact = reply.bytes().len() + 11;
        let query = big_query(Some(1232));
        assert!(
            !decode(&served(&reply, &query, FOREVER, exact))
                .metadata
                .truncation
        );
        let under = decode(&served(&reply, &query, FOREVER, exact - 1));
        assert!(under.metadata.truncation);
        assert_eq!(under.answers.len(), 29);
    }

    /// A reply without OPT to `big.example.com. TXT` of exactly `len` bytes: one TXT record
    /// (compressed owner) whose strings fill it.
    fn txt_reply_of(len: usize) -> Reply {
        use hickory_proto::rr::rdata::TXT;
        let query = query_message(9, "big.example.com.", RecordType::TXT, None);
        let mut msg = response_to(&query);
        // 33 bytes of header and question, 12 of owner pointer and fixed fields.
        let mut left = len - 33 - 12;
        let mut strings = Vec::new();
        while left > 0 {
            let n = (left - 1).min(255);
            strings.push("x".repeat(n));
            left -= n + 1;
        }
        let rdata = RData::TXT(TXT::new(strings));
        msg.add_answer(HickoryRecord::from_rdata(
            name("big.example.com."),
            60,
            rdata,
        ));
        let bytes = encode(&msg);
        assert_eq!(bytes.len(), len);
        Reply::parse(&bytes).unwrap()
    }

    #[test]
    fn a_full_tcp_reply_without_opt_goes_whole_to_an_edns_client_without_one() {
        let reply = txt_reply_of(MAX_MESSAGE_LEN);
        let query = encode(&query_message(
            10,
            "big.example.com.",
            RecordType::TXT,
            Some((1232, false)),
        ));
        let q = Query::parse(&query).unwrap();
        for relayed in [false, true] {
            let mut out = Vec::new();
            if relayed {
                reply.write_relayed(&q, FOREVER, MAX_MESSAGE_LEN, &mut out);
            } else {
                reply.write_answer(&q, FOREVER, MAX_MESSAGE_LEN, &mut out);
            }
            assert_eq!(out.len(), MAX_MESSAGE_LEN);
            let whole = decode(&out);
            assert!(!whole.metadata.truncation);
            assert_eq!(whole.answers.len(), 1);
            assert!(whole.edns.is_none(), "no room for the OPT");
            assert_eq!(whole.metadata.id, 10);
        }
        // With room for it, the OPT is there.
        let smaller = txt_reply_of(MAX_MESSAGE_LEN - 11);
        let out = served(&smaller, &query, FOREVER, MAX_MESSAGE_LEN);
        assert_eq!(out.len(), MAX_MESSAGE_LEN);
        assert!(decode(&out).edns.is_some());
        // Over UDP the OPT stays and the answer is cut: the client can retry over TCP.
        let udp = txt_reply_of(1230);
        let cut = decode(&served(&udp, &query, FOREVER, 1232));
        assert!(cut.metadata.truncation);
        assert!(cut.answers.is_empty());
        assert!(cut.edns.is_some());
    }

    #[test]
    fn cut_keeps_the_sections_in_order() {
        // Two answers, an SOA in the authority section and two additional records: whatever
        // the limit, what is kept is the first records in message order, counted per section.
        let query = query_message(13, "example.com.", RecordType::A, Some((1232, false)));
        let mut msg = response_to(&query);
        msg.add_answer(a("example.com.", 300, 1));
        msg.add_answer(a("example.com.", 300, 2));
        msg.add_authority(soa("example.com.", 30, 5));
        msg.add_additional(a("ns1.example.com.", 60, 3));
        msg.add_additional(a("ns2.example.com.", 60, 4));
        let reply = parse(&msg);
        let query = encode(&query);
        let mut seen = Vec::new();
        for limit in 0..=reply.bytes().len() + 11 {
            let out = decode(&served(&reply, &query, FOREVER, limit));
            let counts = (
                out.answers.len(),
                out.authorities.len(),
                out.additionals.len(),
            );
            let kept = counts.0 + counts.1 + counts.2;
            let expected = match kept {
                0..=2 => (kept, 0, 0),
                3 => (2, 1, 0),
                _ => (2, 1, kept - 3),
            };
            assert_eq!(counts, expected, "limit {limit}");
            assert_eq!(out.answers[..], msg.answers[..counts.0]);
            assert_eq!(out.additionals[..], msg.additionals[..counts.2]);
            assert_eq!(out.metadata.truncation, kept < 5, "limit {limit}");
            assert!(out.edns.is_some(), "the OPT is kept at every limit");
            if !seen.contains(&kept) {
                seen.push(kept);
            }
        }
        assert_eq!(seen, [0, 1, 2, 3, 4, 5], "every cut is reached");
    }

    #[test]
    fn question_alone_is_written_when_no_record_fits() {
        let (_, reply) = big(20);
        for limit in [0, 12, 33 + 27] {
            let out = served(&reply, &big_query(None), FOREVER, limit);
            assert_eq!(out.len(), 33, "limit {limit}");
            let cut = decode(&out);
            assert!(cut.metadata.truncation);
            assert!(cut.answers.is_empty());
        }
    }

    #[test]
    fn reply_of_65535_bytes_without_opt_goes_whole_to_an_edns_client_over_tcp() {
        // 33 bytes of header and question, 4093 A records of 16 bytes, one 14-byte TXT record:
        // 65535 bytes. With the client's OPT the whole cannot go even over TCP: it goes whole
        // without one.
        let mut bytes = b"\x00\x01\x85\x80\x00\x01\x0f\xfe\x00\x00\x00\x00".to_vec();
        bytes.extend_from_slice(b"\x03big\x07example\x03com\x00\x00\x01\x00\x01");
        for i in 0..4093u32 {
            bytes.extend_from_slice(b"\xc0\x0c\x00\x01\x00\x01\x00\x00\x00\x3c\x00\x04");
            bytes.extend_from_slice(&(0x0a00_0000 | i).to_be_bytes());
        }
        bytes.extend_from_slice(b"\xc0\x0c\x00\x10\x00\x01\x00\x00\x00\x3c\x00\x02\x01x");
        assert_eq!(bytes.len(), 65535);
        let reply = Reply::parse(&bytes).unwrap();
        let query = encode(&query_message(
            9,
            "big.example.com.",
            RecordType::A,
            Some((1232, false)),
        ));
        let out = served(&reply, &query, FOREVER, 65535);
        assert_eq!(
            out,
            [&[0, 9], &bytes[2..]].concat(),
            "as the upstream sent it"
        );
        let whole = decode(&out);
        assert!(!whole.metadata.truncation);
        assert_eq!(whole.answers.len(), 4094);
        assert!(whole.edns.is_none());
        // Without an OPT in the query too.
        let plain = encode(&query_message(9, "big.example.com.", RecordType::A, None));
        let whole = served(&reply, &plain, FOREVER, 65535);
        assert_eq!(whole.len(), 65535);
        assert!(!decode(&whole).metadata.truncation);
    }

    #[test]
    fn write_answer_does_not_reallocate_a_warm_buffer() {
        let (_, reply) = big(10);
        let query = encode(&query_message(
            10,
            "big.example.com.",
            RecordType::AAAA,
            Some((1232, true)),
        ));
        let q = Query::parse(&query).unwrap();
        let mut out = Vec::new();
        reply.write_answer(&q, FOREVER, 65535, &mut out);
        let (ptr, capacity) = (out.as_ptr(), out.capacity());
        for age in 0..5 {
            reply.write_answer(&q, TtlRule::fresh(age, 30), 65535, &mut out);
            assert_eq!((out.as_ptr(), out.capacity()), (ptr, capacity));
        }
    }

    #[test]
    fn answers_whole_and_cut_allocate_nothing() {
        let (_, reply) = big(40);
        let plain = big_query(None);
        let edns = big_query(Some(1232));
        let (plain, edns) = (Query::parse(&plain).unwrap(), Query::parse(&edns).unwrap());
        let mut out = Vec::with_capacity(2048);
        let info = allocation_counter::measure(|| {
            for age in 0..100 {
                let ttl = TtlRule::fresh(age, 30);
                // Cut at 512 and at 1232 (1,153 bytes + OPT do not fit), whole over TCP.
                reply.write_answer(&plain, ttl, plain.udp_limit(), &mut out);
                reply.write_answer(&edns, ttl, edns.udp_limit(), &mut out);
                reply.write_relayed(&edns, ttl, 65535, &mut out);
            }
        });
        assert_eq!(info.count_total, 0);
        assert_eq!(decode(&out).answers.len(), 40);
    }

    #[test]
    fn relayed_answers_keep_the_upstreams_aa() {
        let query = query_message(14, "example.com.", RecordType::A, None);
        let bytes = encode(&query);
        let q = Query::parse(&bytes).unwrap();
        for (rcode, aa) in [
            (ResponseCode::Refused, false),
            (ResponseCode::NotImp, false),
            (ResponseCode::FormErr, false),
            (ResponseCode::NoError, false),
            (ResponseCode::NoError, true),
        ] {
            let mut msg = response_to(&query);
            msg.metadata.response_code = rcode;
            msg.metadata.authoritative = aa;
            let reply = parse(&msg);
            let mut out = Vec::new();
            reply.write_relayed(&q, FOREVER, 512, &mut out);
            let relayed = decode(&out);
            assert_eq!(relayed.metadata.authoritative, aa, "{rcode:?} relayed");
            assert_eq!(relayed.metadata.response_code, rcode);
            reply.write_answer(&q, FOREVER, 512, &mut out);
            assert!(
                decode(&out).metadata.authoritative,
                "{rcode:?} from the cache"
            );
        }
    }

    #[test]
    fn stale_rule_gives_every_record_its_ttl() {
        let (_, msg) = positive();
        let mut msg = msg;
        msg.answers[1].ttl = 0;
        let reply = parse(&msg);
        let query = encode(&query_message(15, "example.com.", RecordType::A, None));
        let out = answer(&reply, &query, TtlRule::stale(30), 512);
        let ttls: Vec<u32> = out.answers.iter().map(|r| r.ttl).collect();
        assert_eq!(ttls, [30, 30]);
    }

    #[test]
    fn question_of_another_length_is_not_copied() {
        let (_, msg) = positive();
        let reply = parse(&msg);
        let other = encode(&query_message(11, "www.example.com.", RecordType::A, None));
        let out = answer(&reply, &other, FOREVER, 512);
        assert_eq!(out.queries, msg.queries);
        assert_eq!(out.metadata.id, 11);
    }

    #[test]
    fn question_differing_beyond_case_is_not_copied() {
        let (_, msg) = positive();
        let reply = parse(&msg);
        // Same length as `example.com.`, other labels: answers point into the question.
        let other = encode(&query_message(11, "example.org.", RecordType::A, None));
        let out = answer(&reply, &other, FOREVER, 512);
        assert_eq!(out.queries, msg.queries);
        assert_eq!(out.answers[0].name, name("example.com."));
    }

    #[test]
    fn cname_chain_with_compression_survives() {
        let query = query_message(12, "Www.Example.com.", RecordType::A, Some((1232, false)));
        let mut msg = response_to(&query);
        let cname = RData::CNAME(CNAME(name("web.example.com.")));
        msg.add_answer(HickoryRecord::from_rdata(
            name("www.example.com."),
            100,
            cname,
        ));
        msg.add_answer(a("web.example.com.", 50, 7));
        msg.set_edns(edns(1232, false));
        let reply = parse(&msg);
        let out = answer(&reply, &encode(&query), TtlRule::fresh(10, 60), 1232);
        assert_eq!(out.answers.len(), 2);
        assert_eq!(out.answers[0].data, msg.answers[0].data);
        assert_eq!(out.answers[0].ttl, 60);
        assert_eq!(out.answers[1].ttl, 40);
    }

    fn message(qdcount: u16, question: &[u8]) -> Vec<u8> {
        let mut msg = vec![0x12, 0x34, 0x81, 0x80, 0, 0, 0, 0, 0, 0, 0, 0];
        msg[4..6].copy_from_slice(&qdcount.to_be_bytes());
        msg.extend_from_slice(question);
        msg
    }

    #[test]
    fn same_question_ignores_name_case() {
        let a = message(1, b"\x07ExAmple\x03COM\x00\x00\x01\x00\x01");
        let b = message(1, b"\x07example\x03com\x00\x00\x01\x00\x01extra");
        assert!(same_question(&a, &b));
    }

    #[test]
    fn same_question_compares_type_class_and_labels() {
        let a = message(1, b"\x07example\x03com\x00\x00\x01\x00\x01");
        let other_type = message(1, b"\x07example\x03com\x00\x00\x1c\x00\x01");
        let other_class = message(1, b"\x07example\x03com\x00\x00\x01\x00\x03");
        let other_labels = message(1, b"\x07example\x02co\x01m\x00\x00\x01\x00\x01");
        assert!(!same_question(&a, &other_type));
        assert!(!same_question(&a, &other_class));
        assert!(!same_question(&a, &other_labels));
        // Type 0x0041 (HTTPS) and 0x0061 differ only in what would be ASCII case.
        let https = message(1, b"\x07example\x03com\x00\x00\x41\x00\x01");
        let other = message(1, b"\x07example\x03com\x00\x00\x61\x00\x01");
        assert!(!same_question(&https, &other));
    }

    #[test]
    fn same_question_false_for_malformed_messages() {
        let a = message(1, b"\x07example\x03com\x00\x00\x01\x00\x01");
        assert!(!same_question(&a, &message(2, &a[12..])));
        assert!(!same_question(&a, &a[..a.len() - 1]));
        assert!(!same_question(&a, &a[..5]));
        assert!(!same_question(&message(1, b"\xc0\x0c\x00\x01\x00\x01"), &a));
    }

    #[test]
    fn questions_match_identical_bytes_only_as_a_whole_question() {
        let q = b"\x07example\x03com\x00\x00\x01\x00\x01";
        assert!(questions_match(q, q));
        assert!(questions_match(
            q,
            b"\x07EXAMPLE\x03com\x00\x00\x01\x00\x01"
        ));
        // Fewer bytes than a type and a class: not a question, even compared with itself.
        assert!(!questions_match(b"\x00\x01\x00", b"\x00\x01\x00"));
        assert!(!questions_match(b"", b""));
        assert!(questions_match(
            b"\x00\x00\x01\x00\x01",
            b"\x00\x00\x01\x00\x01"
        ));
    }
}
