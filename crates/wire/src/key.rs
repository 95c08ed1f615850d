//! Cache keys, the upstream query built from one, and the health check's query.

use std::fmt;
use std::hash::{Hash, Hasher};

use crate::name;
use crate::octets::{get16, push_opt, set16};
use crate::{HEADER_LEN, class, flags, rtype};

/// Longest key: a full-length qname, qtype, qclass and one flags byte.
pub const KEY_CAP: usize = crate::MAX_NAME_LEN + 5;

/// Bit of the key's flags byte for DO (RFC 3225).
const KEY_DO: u8 = 0b01;
/// Bit of the key's flags byte for CD (RFC 4035 §3.2.2).
const KEY_CD: u8 = 0b10;

/// What a cached answer is filed under: the lowercased qname in wire form, then qtype and qclass
/// (big-endian), then one byte of flags (bit 0: DO, bit 1: CD).
///
/// DO and CD are in the key because they change what upstream answers (RFC 4035 §3.2.1–3.2.2):
/// an answer fetched without DNSSEC records must not be served to a client that asked for them.
/// The key lives inline (no allocation); the cache copies [`Key::as_bytes`] only on insert.
#[derive(Clone)]
pub struct Key {
    len: u16,
    buf: [u8; KEY_CAP],
}

/// Writes `name` (at most [`crate::MAX_NAME_LEN`] bytes) lowercased at the start of `buf`, eight
/// bytes at a time.
///
/// RFC 4343 §3: names compare case-insensitively in ASCII only. Length bytes (≤ 63) are below
/// `b'A'`, so lowercasing a whole wire name touches label text only.
#[inline(always)]
fn lowercase_name(buf: &mut [u8; KEY_CAP], name: &[u8]) {
    for (to, word) in buf.chunks_exact_mut(8).zip(name.chunks_exact(8)) {
        if let Ok(word) = <[u8; 8]>::try_from(word) {
            to.copy_from_slice(&lowercase_word(word));
        }
    }
    // The last bytes (fewer than eight): the name's last eight bytes, overlapping the word
    // before (lowercasing twice changes nothing); a name shorter than a word, a byte at a time.
    let to = buf
        .get_mut(..name.len())
        .and_then(|b| b.last_chunk_mut::<8>());
    match (name.last_chunk::<8>(), to) {
        (Some(&word), Some(to)) => *to = lowercase_word(word),
        _ => {
            for (to, from) in buf.iter_mut().zip(name) {
                *to = from.to_ascii_lowercase();
            }
        }
    }
}

/// Eight bytes lowercased at once: each byte from `b'A'` to `b'Z'` gets its 0x20 bit. Per byte,
/// with the top bit cleared, adding 0x80 - `b'A'` sets the top bit exactly when the byte is at
/// least `b'A'`, and adding 0x80 - (`b'Z'` + 1) exactly when it is above `b'Z'`; neither sum
/// carries into the next byte (0x7F + 0x3F < 0x100). Bytes with their top bit set are left alone.
fn lowercase_word(bytes: [u8; 8]) -> [u8; 8] {
    const LOW7: u64 = u64::from_ne_bytes([0x7F; 8]);
    const TOP: u64 = u64::from_ne_bytes([0x80; 8]);
    let word = u64::from_ne_bytes(bytes);
    let low = word & LOW7;
    let at_least_a = low + u64::from_ne_bytes([0x80 - b'A'; 8]);
    let above_z = low + u64::from_ne_bytes([0x80 - b'Z' - 1; 8]);
    let upper = (at_least_a ^ above_z) & !word & TOP;
    (word | (upper >> 2)).to_ne_bytes()
}

/// The key's flags byte.
pub(crate) fn flag_bits(dnssec_ok: bool, checking_disabled: bool) -> u8 {
    (if dnssec_ok { KEY_DO } else { 0 }) | (if checking_disabled { KEY_CD } else { 0 })
}

impl Key {
    /// The key of a question: `qname` in wire form (uncompressed, at most 255 bytes, any letter
    /// case), `qtype`, `qclass`, and whether the query had DO (RFC 3225) and CD (RFC 4035
    /// §3.2.2) set. `None` if `qname` is not a well-formed uncompressed name.
    pub fn new(
        qname: &[u8],
        qtype: u16,
        qclass: u16,
        dnssec_ok: bool,
        checking_disabled: bool,
    ) -> Option<Key> {
        if name::skip_uncompressed(qname, 0).ok()? != qname.len() {
            return None;
        }
        Some(Key::from_parts(
            qname,
            qtype,
            qclass,
            flag_bits(dnssec_ok, checking_disabled),
        ))
    }

    /// Builds a key from a question's parts, unchecked. `qname` must be an uncompressed wire name
    /// of at most 255 bytes (as [`crate::Query::qname`] returns); a longer one is cut, never a
    /// panic.
    pub(crate) fn from_parts(qname: &[u8], qtype: u16, qclass: u16, flag_bits: u8) -> Key {
        let mut key = Key::default();
        key.set(qname, qtype, qclass, flag_bits);
        key
    }

    /// Makes this the key of a question's parts, as [`Key::from_parts`] builds it, in place: a
    /// key is 262 bytes, and one returned by value is copied, a `memcpy` on every cache hit.
    #[inline(always)]
    pub(crate) fn set(&mut self, qname: &[u8], qtype: u16, qclass: u16, flag_bits: u8) {
        let name = qname.get(..crate::MAX_NAME_LEN).unwrap_or(qname);
        let name_len = name.len();
        // At most KEY_CAP (260) bytes.
        self.len = (name_len + 5) as u16;
        lowercase_name(&mut self.buf, name);
        let [t0, t1] = qtype.to_be_bytes();
        let [c0, c1] = qclass.to_be_bytes();
        if let Some(tail) = self.buf.get_mut(name_len..name_len + 5) {
            tail.copy_from_slice(&[t0, t1, c0, c1, flag_bits]);
        }
    }

    /// Reads a key back from the bytes [`Key::as_bytes`] returned (as the cache stores them).
    /// Returns `None` unless `bytes` is a well-formed key: an uncompressed name of at most 255
    /// bytes, qtype, qclass, and a flags byte with only the DO and CD bits.
    pub fn from_bytes(bytes: &[u8]) -> Option<Key> {
        let name_end = well_formed(bytes)?;
        let qname = bytes.get(..name_end)?;
        let qtype = get16(bytes, name_end)?;
        let qclass = get16(bytes, name_end + 2)?;
        let flag_bits = *bytes.get(name_end + 4)?;
        Some(Key::from_parts(qname, qtype, qclass, flag_bits))
    }

    /// The key's bytes, in the layout above.
    pub fn as_bytes(&self) -> &[u8] {
        self.buf.get(..usize::from(self.len)).unwrap_or_default()
    }

    /// The lowercased question name in wire form.
    pub fn qname(&self) -> &[u8] {
        self.as_bytes()
            .get(..usize::from(self.len).saturating_sub(5))
            .unwrap_or_default()
    }

    pub fn qtype(&self) -> u16 {
        get16(self.as_bytes(), self.qname().len()).unwrap_or(0)
    }

    pub fn qclass(&self) -> u16 {
        get16(self.as_bytes(), self.qname().len() + 2).unwrap_or(0)
    }

    /// DO (RFC 3225): the client asked for DNSSEC records.
    pub fn dnssec_ok(&self) -> bool {
        self.flag_bits() & KEY_DO != 0
    }

    /// CD (RFC 4035 §3.2.2): the client disabled DNSSEC validation.
    pub fn checking_disabled(&self) -> bool {
        self.flag_bits() & KEY_CD != 0
    }

    fn flag_bits(&self) -> u8 {
        self.as_bytes().last().copied().unwrap_or(0)
    }
}

/// The empty key (no name): what [`crate::Query::key_into`] overwrites.
impl Default for Key {
    fn default() -> Key {
        Key {
            len: 0,
            buf: [0; KEY_CAP],
        }
    }
}

impl PartialEq for Key {
    fn eq(&self, other: &Self) -> bool {
        self.as_bytes() == other.as_bytes()
    }
}

impl Eq for Key {}

impl Hash for Key {
    fn hash<H: Hasher>(&self, state: &mut H) {
        self.as_bytes().hash(state);
    }
}

impl fmt::Debug for Key {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Key")
            .field("qname", &Presentation(self.qname()))
            .field("qtype", &self.qtype())
            .field("qclass", &self.qclass())
            .field("dnssec_ok", &self.dnssec_ok())
            .field("checking_disabled", &self.checking_disabled())
            .finish()
    }
}

/// A wire name shown in presentation form (RFC 1035 §5.1), `\DDD` for bytes that are not
/// printable.
struct Presentation<'a>(&'a [u8]);

impl fmt::Debug for Presentation<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("\"")?;
        let mut rest = self.0;
        if rest.first() == Some(&0) {
            f.write_str(".")?;
        }
        while let Some((&len, tail)) = rest.split_first() {
            if len == 0 {
                break;
            }
            let (label, tail) = tail.split_at(usize::from(len).min(tail.len()));
            for &b in label {
                match b {
                    b'.' | b'\\' | b'"' => write!(f, "\\{}", b as char)?,
                    0x21..=0x7E => write!(f, "{}", b as char)?,
                    _ => write!(f, "\\{b:03}")?,
                }
            }
            f.write_str(".")?;
            rest = tail;
        }
        f.write_str("\"")
    }
}

/// Checks the key layout; returns where the name ends.
fn well_formed(key: &[u8]) -> Option<usize> {
    let name_end = name::skip_uncompressed(key, 0).ok()?;
    if key.len() != name_end + 5 {
        return None;
    }
    let flag_bits = *key.last()?;
    (flag_bits & !(KEY_DO | KEY_CD) == 0).then_some(name_end)
}

/// Writes into `out` (cleared first) the query nodedns sends upstream for a key: ID `id`, RD set,
/// CD from the key, the key's (lowercased) question, and an OPT record advertising
/// [`crate::EDNS_UDP_SIZE`] with DO from the key. Returns `None` if `key` is not a well-formed key.
pub fn build_query(key: &[u8], id: u16, out: &mut Vec<u8>) -> Option<()> {
    let name_end = well_formed(key)?;
    let flag_bits = *key.last()?;
    out.clear();
    let mut header_flags = flags::RD;
    if flag_bits & KEY_CD != 0 {
        header_flags |= flags::CD;
    }
    out.extend_from_slice(&[0; HEADER_LEN]);
    set16(out, 0, id);
    set16(out, 2, header_flags);
    set16(out, 4, 1); // QDCOUNT
    set16(out, 10, 1); // ARCOUNT: the OPT
    out.extend_from_slice(key.get(..name_end + 4)?);
    // RFC 6891 §7: a requestor includes an OPT to advertise its payload size; RFC 3225 §3: DO
    // asks for DNSSEC records.
    push_opt(out, 0, flag_bits & KEY_DO != 0);
    Some(())
}

/// Length of [`root_ns_query`]'s message: the header, the root name, qtype and qclass.
const ROOT_NS_QUERY_LEN: usize = HEADER_LEN + 5;

/// The query `. IN NS` with ID `id` and RD set, and no OPT: what CoreDNS's `forward` sends as its
/// health check (any response to it means the upstream is alive).
pub fn root_ns_query(id: u16) -> [u8; ROOT_NS_QUERY_LEN] {
    let mut msg = [0u8; ROOT_NS_QUERY_LEN];
    set16(&mut msg, 0, id);
    set16(&mut msg, 2, flags::RD);
    set16(&mut msg, 4, 1); // QDCOUNT
    // msg[HEADER_LEN] = 0: the root name.
    set16(&mut msg, HEADER_LEN + 1, rtype::NS);
    set16(&mut msg, HEADER_LEN + 3, class::IN);
    msg
}

/// The query `QNAME IN NS` with ID `id`, RD set when `rd`, and no OPT: CoreDNS's `forward`
/// health check with its `domain` and `no_rec` options (`qname` in wire form, uncompressed).
pub fn ns_query(id: u16, qname: &[u8], rd: bool) -> Vec<u8> {
    let mut msg = vec![0u8; HEADER_LEN];
    set16(&mut msg, 0, id);
    set16(&mut msg, 2, if rd { flags::RD } else { 0 });
    set16(&mut msg, 4, 1); // QDCOUNT
    msg.extend_from_slice(qname);
    msg.extend_from_slice(&rtype::NS.to_be_bytes());
    msg.extend_from_slice(&class::IN.to_be_bytes());
    msg
}

#[cfg(test)]
mod tests {
    use hickory_proto::op::MessageType;
    use hickory_proto::rr::{DNSClass, RecordType};

    use super::*;
    use crate::testutil::{decode, name};

    #[test]
    fn the_key_lowercases_every_byte_as_the_byte_at_a_time_rule_does() {
        for len in 1..=20 {
            for b in 0..=u8::MAX {
                for at in 0..len {
                    let mut qname: Vec<u8> = (0..len as u8).map(|i| b'@' + i).collect();
                    qname[at] = b;
                    let key = Key::from_parts(&qname, 0x4142, 0x4344, 3);
                    let mut expected: Vec<u8> = qname.iter().map(u8::to_ascii_lowercase).collect();
                    expected.extend_from_slice(&[0x41, 0x42, 0x43, 0x44, 3]);
                    assert_eq!(key.as_bytes(), &expected[..], "len {len}, {b:#04x} at {at}");
                }
            }
        }
        let longest = [b'A'; crate::MAX_NAME_LEN];
        let key = Key::from_parts(&longest, 1, 1, 0);
        assert_eq!(key.qname(), &[b'a'; crate::MAX_NAME_LEN][..]);
    }

    fn key(qname: &[u8], flag_bits: u8) -> Key {
        Key::from_parts(qname, rtype_a(), 1, flag_bits)
    }

    fn rtype_a() -> u16 {
        crate::rtype::A
    }

    #[test]
    fn build_query_is_what_hickory_reads() {
        let key = key(b"\x03www\x07example\x03com\x00", KEY_DO | KEY_CD);
        let mut out = vec![0xAA; 3];
        build_query(key.as_bytes(), 0x4242, &mut out).unwrap();
        let msg = decode(&out);
        assert_eq!(msg.metadata.id, 0x4242);
        assert_eq!(msg.metadata.message_type, MessageType::Query);
        assert!(msg.metadata.recursion_desired);
        assert!(msg.metadata.checking_disabled);
        assert_eq!(msg.queries.len(), 1);
        assert_eq!(msg.queries[0].name(), &name("www.example.com."));
        assert_eq!(msg.queries[0].query_type(), RecordType::A);
        assert_eq!(msg.queries[0].query_class(), DNSClass::IN);
        let edns = msg.edns.as_ref().unwrap();
        assert_eq!(edns.max_payload(), crate::EDNS_UDP_SIZE);
        assert_eq!(edns.version(), 0);
        assert!(edns.flags().dnssec_ok);
    }

    #[test]
    fn build_query_without_do_or_cd() {
        let key = key(b"\x07example\x00", 0);
        let mut out = Vec::new();
        build_query(key.as_bytes(), 1, &mut out).unwrap();
        let msg = decode(&out);
        assert!(!msg.metadata.checking_disabled);
        assert!(!msg.edns.unwrap().flags().dnssec_ok);
    }

    #[test]
    fn build_query_rejects_malformed_keys() {
        let mut out = Vec::new();
        let good = key(b"\x07example\x00", KEY_DO).as_bytes().to_vec();
        assert!(build_query(&good, 1, &mut out).is_some());
        assert!(build_query(&good[..good.len() - 1], 1, &mut out).is_none());
        let mut long = good.clone();
        long.push(0);
        assert!(build_query(&long, 1, &mut out).is_none());
        let mut bad_flags = good.clone();
        *bad_flags.last_mut().unwrap() = 0x04;
        assert!(build_query(&bad_flags, 1, &mut out).is_none());
        assert!(build_query(b"\xc0\x00\x00\x01\x00\x01\x00", 1, &mut out).is_none());
        assert!(build_query(&[], 1, &mut out).is_none());
    }

    #[test]
    fn key_round_trips_through_bytes() {
        let original = key(b"\x03www\x07example\x00", KEY_CD);
        let back = Key::from_bytes(original.as_bytes()).unwrap();
        assert_eq!(back, original);
        assert!(back.checking_disabled());
        assert!(!back.dnssec_ok());
        assert!(Key::from_bytes(b"\x03www").is_none());
    }

    #[test]
    fn key_lowercases_ascii_only() {
        // RFC 4343 §3: only A-Z fold; 0xC4 (Ä in Latin-1) stays as it is.
        let key = key(b"\x03A\xc4z\x00", 0);
        assert_eq!(key.qname(), b"\x03a\xc4z\x00");
    }

    #[test]
    fn key_debug_shows_the_name_in_presentation_form() {
        let text = format!("{:?}", key(b"\x03w.w\x07example\x00", KEY_DO));
        assert!(text.contains(r#"qname: "w\.w.example.""#), "{text}");
        assert!(text.contains("qtype: 1"), "{text}");
        assert!(text.contains("dnssec_ok: true"), "{text}");
        let root = format!("{:?}", key(b"\x00", 0));
        assert!(root.contains(r#"qname: ".""#), "{root}");
    }

    #[test]
    fn full_length_name_fits_the_key() {
        let mut qname = Vec::new();
        for len in [63u8, 63, 63, 61] {
            qname.push(len);
            qname.extend(std::iter::repeat_n(b'x', usize::from(len)));
        }
        qname.push(0);
        let key = key(&qname, KEY_DO);
        assert_eq!(key.as_bytes().len(), KEY_CAP);
        assert_eq!(key.qname(), &qname[..]);
        assert!(key.dnssec_ok());
    }

    #[test]
    fn the_public_constructor_builds_what_a_parsed_query_does() {
        let msg = crate::testutil::encode(&crate::testutil::query_message(
            9,
            "WwW.Example.",
            RecordType::HINFO,
            Some((1232, true)),
        ));
        let parsed = crate::Query::parse(&msg).unwrap().key();
        let built = Key::new(
            b"\x03WwW\x07Example\x00",
            rtype::HINFO,
            class::IN,
            true,
            false,
        )
        .expect("a well-formed name");
        assert_eq!(built, parsed);
        assert_eq!(built.qname(), b"\x03www\x07example\x00");
        assert!(built.dnssec_ok() && !built.checking_disabled());
        let cd = Key::new(b"\x00", rtype::NS, class::IN, false, true).unwrap();
        assert!(!cd.dnssec_ok() && cd.checking_disabled());
    }

    #[test]
    fn the_public_constructor_rejects_what_is_not_one_uncompressed_name() {
        for bad in [
            &b""[..],
            b"\x03www",
            b"\x03www\x00\x00",
            b"\xc0\x0c",
            b"\x03www\xc0\x0c",
        ] {
            assert!(Key::new(bad, 1, 1, false, false).is_none(), "{bad:02x?}");
        }
        let mut long = Vec::new();
        for _ in 0..5 {
            long.push(63);
            long.extend([b'x'; 63]);
        }
        long.push(0);
        assert!(
            Key::new(&long, 1, 1, false, false).is_none(),
            "over 255 bytes"
        );
    }

    #[test]
    fn root_ns_query_is_what_coredns_sends_as_a_health_check() {
        let msg = decode(&root_ns_query(0x1234));
        assert_eq!(msg.metadata.id, 0x1234);
        assert_eq!(msg.metadata.message_type, MessageType::Query);
        assert!(msg.metadata.recursion_desired);
        assert_eq!(msg.queries.len(), 1);
        assert!(msg.queries[0].name().is_root());
        assert_eq!(msg.queries[0].query_type(), RecordType::NS);
        assert_eq!(msg.queries[0].query_class(), DNSClass::IN);
        assert!(msg.edns.is_none());
        assert!(msg.additionals.is_empty());
    }
}
