//! Cache keys and the upstream query built from one.

/// Longest key: a full-length qname, qtype, qclass and one flags byte.
pub const KEY_CAP: usize = crate::MAX_NAME_LEN + 5;

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

impl Key {
    /// The key's bytes, in the layout above.
    pub fn as_bytes(&self) -> &[u8] {
        &self.buf[..self.len as usize]
    }
}

/// Writes into `out` (cleared first) the query nodedns sends upstream for a key: ID `id`, RD set,
/// CD from the key, the key's (lowercased) question, and an OPT record advertising
/// [`crate::EDNS_UDP_SIZE`] with DO from the key. Returns `None` if `key` is not a well-formed key.
pub fn build_query(key: &[u8], id: u16, out: &mut Vec<u8>) -> Option<()> {
    let _ = (key, id, out);
    todo!()
}
