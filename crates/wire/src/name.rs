//! Walking names in wire form (RFC 1035 §3.1, §4.1.4), shared by the query and reply parsers.
//!
//! Rules enforced on every name:
//! - a label is at most 63 bytes: its length byte has its two top bits clear (RFC 1035 §2.3.4);
//!   the label types 0b01 (extended labels, RFC 6891 §5 retired them) and 0b10 are rejected;
//! - a name is at most 255 bytes in wire form, counting every length byte and the root label
//!   (RFC 1035 §2.3.4), whether or not it is compressed;
//! - a compression pointer (0b11, RFC 1035 §4.1.4) refers to "a prior occurrence": its target
//!   must lie before the start of the run of labels that contains it. Targets therefore strictly
//!   decrease, so pointer loops are impossible; a jump limit caps the work anyway;
//! - the labels a pointer leads to must end before the run of labels holding that pointer
//!   begins (the target is an earlier, complete name; hickory-proto enforces the same);
//! - a pointer never targets the header (offsets 0..12 hold no name, and nodedns rewrites the ID,
//!   flags and counts of every answer it serves).

use crate::{HEADER_LEN, MAX_NAME_LEN};

/// Most pointers followed in one name. Each jump of a real encoder skips at least one label, and
/// a 255-byte name has at most 127 labels.
const MAX_JUMPS: usize = MAX_NAME_LEN / 2;

/// Why a name could not be walked.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum NameError {
    /// A pointer where none is allowed or pointing forwards, a reserved label type, a label over
    /// 63 bytes, a name over 255 bytes, or too many jumps.
    Malformed,
    /// The message ends inside the name.
    Truncated,
}

/// Whether the uncompressed wire name `name` is `zone` or below it (both lowercase, as in cache
/// keys): `zone` is a suffix of `name` that starts at a label boundary. A malformed `name` is
/// under nothing.
pub fn is_subdomain(name: &[u8], zone: &[u8]) -> bool {
    if !name.ends_with(zone) {
        return false;
    }
    let mut at = 0;
    while let Some(rest) = name.get(at..) {
        if rest.len() == zone.len() {
            return true;
        }
        match rest.first() {
            Some(&len) if len != 0 && len & 0xC0 == 0 => at += 1 + usize::from(len),
            _ => return false,
        }
    }
    false
}

/// Walks an uncompressed name starting at `start` (a question name: RFC 1035 §4.1.4 allows
/// pointers only to a prior occurrence, and nothing in a message precedes the question's name).
/// Returns the offset just past the root label.
pub(crate) fn skip_uncompressed(msg: &[u8], start: usize) -> Result<usize, NameError> {
    let mut pos = start;
    loop {
        let len = *msg.get(pos).ok_or(NameError::Truncated)?;
        if len & 0xC0 != 0 {
            // A pointer, or the reserved label types 0b01 and 0b10.
            return Err(NameError::Malformed);
        }
        let next = pos + 1 + usize::from(len);
        if next - start > MAX_NAME_LEN {
            return Err(NameError::Malformed);
        }
        if len == 0 {
            return Ok(next);
        }
        pos = next;
    }
}

/// Walks a possibly compressed name starting at `start`. Returns the offset just past the name's
/// own bytes at `start` (after its first pointer, or after its root label), having checked the
/// whole name, pointers followed.
pub(crate) fn skip(msg: &[u8], start: usize) -> Result<usize, NameError> {
    skip_avoiding(msg, start, &[])
}

/// [`skip`], and a name whose labels (once a pointer is followed) read any byte of a 32-bit field
/// at one of the ascending offsets `fields` is malformed. The reply parser passes its TTL
/// offsets: a name built from TTL bytes would change when the TTLs are patched.
pub(crate) fn skip_avoiding(msg: &[u8], start: usize, fields: &[u16]) -> Result<usize, NameError> {
    let mut pos = start;
    // Start of the run of labels being read: the next pointer must point before it.
    let mut run_start = start;
    // After a jump, every byte read must lie before the start of the run that held the pointer:
    // the "prior occurrence" is a whole earlier name, not one that runs on into this one.
    let mut read_limit = usize::MAX;
    // Where the name ends in the record stream, once a pointer has been taken.
    let mut end = None;
    let mut wire_len = 0usize;
    let mut jumps = 0usize;
    // Whether the bytes `pos..next` may be read as part of this name.
    let readable = |end: Option<usize>, read_limit: usize, pos: usize, next: usize| {
        end.is_none() || (next <= read_limit && !overlaps(fields, pos, next))
    };
    loop {
        let len = *msg.get(pos).ok_or(NameError::Truncated)?;
        match len & 0xC0 {
            0x00 => {
                let next = pos + 1 + usize::from(len);
                wire_len += 1 + usize::from(len);
                if wire_len > MAX_NAME_LEN || !readable(end, read_limit, pos, next) {
                    return Err(NameError::Malformed);
                }
                if len == 0 {
                    return Ok(end.unwrap_or(next));
                }
                pos = next;
            }
            0xC0 => {
                let low = *msg.get(pos + 1).ok_or(NameError::Truncated)?;
                let target = usize::from(len & 0x3F) << 8 | usize::from(low);
                jumps += 1;
                if target >= run_start
                    || target < HEADER_LEN
                    || jumps > MAX_JUMPS
                    || !readable(end, read_limit, pos, pos + 2)
                {
                    return Err(NameError::Malformed);
                }
                end.get_or_insert(pos + 2);
                read_limit = run_start;
                pos = target;
                run_start = target;
            }
            _ => return Err(NameError::Malformed),
        }
    }
}

/// Whether `from..to` shares a byte with any 4-byte field starting at the ascending `fields`.
fn overlaps(fields: &[u16], from: usize, to: usize) -> bool {
    // The first field that ends after `from`; it overlaps if it starts before `to`.
    let first = fields.partition_point(|&at| usize::from(at) + 4 <= from);
    fields.get(first).is_some_and(|&at| usize::from(at) < to)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn is_subdomain_needs_a_label_boundary() {
        let example = b"\x07example\x03com\x00";
        assert!(is_subdomain(b"\x03www\x07example\x03com\x00", example));
        assert!(is_subdomain(example, example));
        assert!(is_subdomain(example, b"\x00"));
        assert!(!is_subdomain(b"\x0abadexample\x03com\x00", example));
        assert!(!is_subdomain(b"\x03com\x00", example));
        // A label that runs past the end, or a pointer, is under nothing.
        assert!(!is_subdomain(b"\x3fexample\x03com\x00", b"\x03com\x00"));
        assert!(!is_subdomain(b"\xc0\x0c\x07example\x03com\x00", example));
    }

    /// `example.com.` in wire form.
    const EXAMPLE: &[u8] = b"\x07example\x03com\x00";

    #[test]
    fn uncompressed_name_ends_after_root_label() {
        let mut msg = vec![0u8; 12];
        msg.extend_from_slice(EXAMPLE);
        msg.extend_from_slice(&[0, 1, 0, 1]);
        assert_eq!(skip_uncompressed(&msg, 12), Ok(12 + EXAMPLE.len()));
        assert_eq!(skip(&msg, 12), Ok(12 + EXAMPLE.len()));
    }

    #[test]
    fn root_name_is_one_byte() {
        assert_eq!(skip_uncompressed(&[0], 0), Ok(1));
        assert_eq!(skip(&[0], 0), Ok(1));
    }

    #[test]
    fn pointer_rejected_in_uncompressed_name() {
        let mut msg = EXAMPLE.to_vec();
        msg.extend_from_slice(&[0xC0, 0x00]);
        assert_eq!(
            skip_uncompressed(&msg, EXAMPLE.len()),
            Err(NameError::Malformed)
        );
    }

    /// `bytes` after a 12-byte stand-in header, so offsets in tests read `H + n`.
    fn after_header(bytes: &[u8]) -> Vec<u8> {
        let mut msg = vec![0xFF; HEADER_LEN];
        msg.extend_from_slice(bytes);
        msg
    }

    const H: u8 = HEADER_LEN as u8;

    #[test]
    fn backward_pointer_followed_and_name_ends_after_it() {
        let mut msg = after_header(EXAMPLE);
        let start = msg.len();
        msg.extend_from_slice(&[3, b'w', b'w', b'w', 0xC0, H]);
        assert_eq!(skip(&msg, start), Ok(msg.len()));
        // Pointer to the middle of a name: `com.`.
        let start = msg.len();
        msg.extend_from_slice(&[0xC0, H + 8]);
        assert_eq!(skip(&msg, start), Ok(msg.len()));
    }

    #[test]
    fn forward_pointer_rejected() {
        let mut msg = after_header(&[0xC0, H + 2]);
        msg.extend_from_slice(EXAMPLE);
        assert_eq!(skip(&msg, 12), Err(NameError::Malformed));
    }

    #[test]
    fn self_pointer_rejected() {
        assert_eq!(
            skip(&after_header(&[0xC0, H]), 12),
            Err(NameError::Malformed)
        );
    }

    #[test]
    fn pointer_into_the_header_rejected() {
        // The header bytes 0xFF... would not even be labels; a root byte there is still refused.
        let mut msg = vec![0; HEADER_LEN];
        msg.extend_from_slice(&[0xC0, 0x0B]);
        assert_eq!(skip(&msg, 12), Err(NameError::Malformed));
    }

    #[test]
    fn pointer_loop_rejected() {
        // Label "a" then a pointer back to it: a loop that only labels could keep going.
        let msg = after_header(&[0x01, b'a', 0xC0, H]);
        assert_eq!(skip(&msg, 12), Err(NameError::Malformed));
        // A pointer at H+4 to H, whose run contains a pointer back to H+4.
        let msg = after_header(&[0x01, b'a', 0xC0, H + 4, 0xC0, H]);
        assert_eq!(skip(&msg, 16), Err(NameError::Malformed));
    }

    #[test]
    fn pointer_into_a_longer_run_cannot_loop() {
        // Label at H covers H+1..=H+4; the pointer at H+5 goes back to H and the walk reads the
        // same pointer again: the second jump is not before the run it is in.
        let msg = after_header(&[0x04, b'a', b'b', b'c', b'd', 0xC0, H]);
        assert_eq!(skip(&msg, 17), Err(NameError::Malformed));
    }

    #[test]
    fn name_reached_through_a_pointer_must_end_before_the_pointing_name() {
        // At H a 4-byte label starts whose text would be the pointing name's own bytes.
        let mut msg = after_header(&[0x01, b'x', 0x04]);
        let start = msg.len();
        msg.extend_from_slice(&[0x01, b'a', 0xC0, H + 2, 0x00]);
        assert_eq!(skip(&msg, start), Err(NameError::Malformed));
        // An earlier name ending right where the pointing name begins is fine.
        let mut msg = after_header(&[0x01, b'x', 0x00]);
        let start = msg.len();
        msg.extend_from_slice(&[0xC0, H]);
        assert_eq!(skip(&msg, start), Ok(start + 2));
    }

    #[test]
    fn name_read_through_a_pointer_must_avoid_the_given_fields() {
        // H: "\x01a\x00"; H+3..H+7 is a "TTL" holding bytes that read as a label and the root.
        let mut msg = after_header(&[0x01, b'a', 0x00, 0x02, b'b', b'c', 0x00]);
        let start = msg.len();
        msg.extend_from_slice(&[0xC0, H + 3]);
        let ttl = [u16::from(H) + 3];
        assert_eq!(skip(&msg, start), Ok(msg.len()));
        assert_eq!(skip_avoiding(&msg, start, &ttl), Err(NameError::Malformed));
        // Pointing at H (before the field) is fine: that name ends before it.
        let start = msg.len();
        msg.extend_from_slice(&[0xC0, H]);
        assert_eq!(skip_avoiding(&msg, start, &ttl), Ok(msg.len()));
        // The name's own bytes (before any pointer) are not checked: they are the caller's.
        assert_eq!(skip_avoiding(&msg, 15, &ttl), Ok(19));
    }

    #[test]
    fn overlap_is_exact_at_the_field_edges() {
        let fields = [10u16, 20];
        assert!(!overlaps(&fields, 0, 10));
        assert!(overlaps(&fields, 0, 11));
        assert!(overlaps(&fields, 13, 14));
        assert!(!overlaps(&fields, 14, 20));
        assert!(overlaps(&fields, 23, 30));
        assert!(!overlaps(&fields, 24, 30));
        assert!(!overlaps(&[], 0, 100));
    }

    #[test]
    fn label_of_64_bytes_rejected() {
        let mut msg = vec![64u8];
        msg.extend_from_slice(&[b'a'; 64]);
        msg.push(0);
        assert_eq!(skip_uncompressed(&msg, 0), Err(NameError::Malformed));
        assert_eq!(skip(&msg, 0), Err(NameError::Malformed));
    }

    #[test]
    fn label_of_63_bytes_accepted() {
        let mut msg = vec![63u8];
        msg.extend_from_slice(&[b'a'; 63]);
        msg.push(0);
        assert_eq!(skip_uncompressed(&msg, 0), Ok(65));
    }

    #[test]
    fn reserved_label_types_rejected() {
        for first in [0x41u8, 0x80] {
            let msg = [first, 0, 0, 0];
            assert_eq!(skip_uncompressed(&msg, 0), Err(NameError::Malformed));
            assert_eq!(skip(&msg, 0), Err(NameError::Malformed));
        }
    }

    /// A name of exactly `len` bytes in wire form (len ≥ 1), in labels of up to 63 bytes.
    fn name_of_len(len: usize) -> Vec<u8> {
        let mut name = Vec::new();
        let mut left = len - 1;
        while left > 0 {
            let label = (left - 1).min(63);
            // Avoid leaving exactly one byte, which cannot hold a label.
            let label = if left - 1 - label == 1 {
                label - 1
            } else {
                label
            };
            name.push(label as u8);
            name.extend(std::iter::repeat_n(b'x', label));
            left -= 1 + label;
        }
        name.push(0);
        assert_eq!(name.len(), len);
        name
    }

    #[test]
    fn name_of_255_bytes_accepted_256_rejected() {
        let ok = name_of_len(255);
        assert_eq!(skip_uncompressed(&ok, 0), Ok(255));
        assert_eq!(skip(&ok, 0), Ok(255));
        let long = name_of_len(256);
        assert_eq!(skip_uncompressed(&long, 0), Err(NameError::Malformed));
        assert_eq!(skip(&long, 0), Err(NameError::Malformed));
    }

    #[test]
    fn compressed_name_over_255_bytes_rejected() {
        // 200 bytes of labels, then a pointer to another 200-byte name: 399 bytes expanded.
        let mut msg = after_header(&name_of_len(200));
        let start = msg.len();
        msg.extend_from_slice(&name_of_len(200)[..199]);
        msg.extend_from_slice(&[0xC0, H]);
        assert_eq!(skip(&msg, start), Err(NameError::Malformed));
    }

    #[test]
    fn name_running_past_the_end_is_truncated() {
        assert_eq!(skip_uncompressed(b"\x07exam", 0), Err(NameError::Truncated));
        assert_eq!(skip(b"\x07example", 0), Err(NameError::Truncated));
        assert_eq!(
            skip(b"\x07example\x03com\x00\xC0", 13),
            Err(NameError::Truncated)
        );
        assert_eq!(skip(&[], 0), Err(NameError::Truncated));
    }
}
