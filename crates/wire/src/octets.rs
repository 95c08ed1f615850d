//! Bounds-checked big-endian reads and writes on byte slices: the only way the parsers touch
//! bytes, so no index can go out of bounds and no offset arithmetic can overflow.

/// The 16-bit big-endian integer at `at`, if the slice holds it.
pub(crate) fn get16(bytes: &[u8], at: usize) -> Option<u16> {
    let b = bytes.get(at..at.checked_add(2)?)?;
    Some(u16::from_be_bytes([b[0], b[1]]))
}

/// The 32-bit big-endian integer at `at`, if the slice holds it.
pub(crate) fn get32(bytes: &[u8], at: usize) -> Option<u32> {
    let b = bytes.get(at..at.checked_add(4)?)?;
    Some(u32::from_be_bytes([b[0], b[1], b[2], b[3]]))
}

/// Overwrites the 16 bits at `at`; does nothing if the slice is too short.
pub(crate) fn set16(bytes: &mut [u8], at: usize, value: u16) {
    if let Some(b) = at.checked_add(2).and_then(|end| bytes.get_mut(at..end)) {
        b.copy_from_slice(&value.to_be_bytes());
    }
}

/// Overwrites the 32 bits at `at`; does nothing if the slice is too short.
pub(crate) fn set32(bytes: &mut [u8], at: usize, value: u32) {
    if let Some(b) = at.checked_add(4).and_then(|end| bytes.get_mut(at..end)) {
        b.copy_from_slice(&value.to_be_bytes());
    }
}

/// Header field offsets (RFC 1035 §4.1.1).
pub(crate) mod header {
    pub(crate) const ID: usize = 0;
    pub(crate) const FLAGS: usize = 2;
    pub(crate) const QDCOUNT: usize = 4;
    pub(crate) const ANCOUNT: usize = 6;
    pub(crate) const NSCOUNT: usize = 8;
    pub(crate) const ARCOUNT: usize = 10;
}

/// Appends an OPT record (RFC 6891 §6.1.2): root owner name, TYPE 41, CLASS = our UDP payload
/// size, TTL = extended RCODE (upper 8 bits), version 0, DO (RFC 3225 §3), no options.
pub(crate) fn push_opt(out: &mut Vec<u8>, ext_rcode: u8, dnssec_ok: bool) {
    let [size_hi, size_lo] = crate::EDNS_UDP_SIZE.to_be_bytes();
    let [opt_hi, opt_lo] = crate::rtype::OPT.to_be_bytes();
    let do_bit = if dnssec_ok { 0x80 } else { 0 };
    out.extend_from_slice(&[
        0, opt_hi, opt_lo, size_hi, size_lo, ext_rcode, 0, do_bit, 0, 0, 0,
    ]);
}

/// Length of the record [`push_opt`] writes.
pub(crate) const OPT_LEN: usize = 11;
