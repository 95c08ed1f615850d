//! The bytes of a cache carried between instances: the same in the snapshot file and in the
//! stream a running instance writes to the next one. No I/O here.
//!
//! ```text
//! header   "NODEDNS-CACHE\0" (14 bytes) | version u16 | written u64 (ms since the Unix epoch)
//!          | CRC-32 of the 24 bytes before it (u32)
//! record   tag u8 | length u32 | payload (length bytes) | CRC-32 of tag, length and payload
//!   'B'    a server block: its identity (UTF-8), which the entries after it belong to
//!   'E'    an entry: age (ms, u64) | flags u8 (bit 0: hot) | key length u16 | key | reply
//!   'Z'    the end: the number of entries written (u64); nothing may follow
//! ```
//!
//! Integers are big-endian. The version changes whenever the layout does; a reader refuses any
//! version but its own. Each record carries its own checksum, so a stream is checked as it
//! comes, and a record's length is bounded ([`MAX_PAYLOAD`]) before anything is reserved for it.

use std::time::Duration;

/// What the bytes start with.
pub const MAGIC: &[u8; 14] = b"NODEDNS-CACHE\0";
/// The layout's version.
pub const VERSION: u16 = 1;
/// Bytes of the header.
pub const HEADER_LEN: usize = MAGIC.len() + 2 + 8 + 4;
/// The largest payload a record may have: an entry with the longest key and a 64 KiB reply.
pub const MAX_PAYLOAD: usize = 8 + 1 + 2 + nodedns_wire::KEY_CAP + 65_535;
/// Bytes a record adds to its payload (tag, length, checksum).
pub const RECORD_OVERHEAD: usize = 1 + 4 + 4;

const BLOCK: u8 = b'B';
const ENTRY: u8 = b'E';
const END: u8 = b'Z';
const HOT: u8 = 0b1;

/// One record, borrowing from the bytes it was read from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Record<'a> {
    Block(&'a str),
    Entry {
        age: Duration,
        hot: bool,
        key: &'a [u8],
        reply: &'a [u8],
    },
    End {
        entries: u64,
    },
}

/// Why bytes are not a carried cache.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum FormatError {
    #[error("not a nodedns cache (no magic)")]
    Magic,
    #[error("layout version {0}, this instance reads {VERSION}")]
    Version(u16),
    #[error("checksum mismatch")]
    Checksum,
    #[error("a record of {0} bytes, more than any entry takes")]
    Length(u32),
    #[error("unknown record tag {0:#04x}")]
    Tag(u8),
    #[error("malformed {0} record")]
    Malformed(&'static str),
    #[error("bytes after the end record")]
    Trailing,
}

/// The header, for bytes written `written_ms` after the Unix epoch.
pub fn header(written_ms: u64) -> [u8; HEADER_LEN] {
    let mut out = [0u8; HEADER_LEN];
    out[..14].copy_from_slice(MAGIC);
    out[14..16].copy_from_slice(&VERSION.to_be_bytes());
    out[16..24].copy_from_slice(&written_ms.to_be_bytes());
    let crc = crc32(&out[..24]);
    out[24..].copy_from_slice(&crc.to_be_bytes());
    out
}

/// Reads a header: when the bytes were written (ms since the Unix epoch). `Ok(None)` while
/// fewer than [`HEADER_LEN`] bytes are there.
pub fn read_header(bytes: &[u8]) -> Result<Option<u64>, FormatError> {
    // A wrong start is refused as soon as it shows, not once a whole header came.
    let seen = bytes.len().min(MAGIC.len());
    if bytes[..seen] != MAGIC[..seen] {
        return Err(FormatError::Magic);
    }
    let Some(header) = bytes.get(..HEADER_LEN) else {
        return Ok(None);
    };
    let version = u16::from_be_bytes([header[14], header[15]]);
    if crc32(&header[..24]) != be32(&header[24..]) {
        return Err(FormatError::Checksum);
    }
    if version != VERSION {
        return Err(FormatError::Version(version));
    }
    Ok(Some(u64::from_be_bytes(
        header[16..24].try_into().unwrap_or_default(),
    )))
}

/// Appends `record` to `out`.
pub fn write_record(out: &mut Vec<u8>, record: &Record<'_>) {
    let start = out.len();
    let tag = match record {
        Record::Block(_) => BLOCK,
        Record::Entry { .. } => ENTRY,
        Record::End { .. } => END,
    };
    out.push(tag);
    out.extend_from_slice(&[0; 4]);
    match record {
        Record::Block(identity) => out.extend_from_slice(identity.as_bytes()),
        Record::Entry {
            age,
            hot,
            key,
            reply,
        } => {
            let age = u64::try_from(age.as_millis()).unwrap_or(u64::MAX);
            out.extend_from_slice(&age.to_be_bytes());
            out.push(if *hot { HOT } else { 0 });
            // Keys are at most KEY_CAP (260) bytes.
            out.extend_from_slice(&(key.len() as u16).to_be_bytes());
            out.extend_from_slice(key);
            out.extend_from_slice(reply);
        }
        Record::End { entries } => out.extend_from_slice(&entries.to_be_bytes()),
    }
    let length = (out.len() - start - 5) as u32;
    out[start + 1..start + 5].copy_from_slice(&length.to_be_bytes());
    let crc = crc32(&out[start..]);
    out.extend_from_slice(&crc.to_be_bytes());
}

/// Reads the record at the start of `bytes`: the record and the bytes it took, or `Ok(None)`
/// while the record is not all there yet. Checks the length bound before waiting for the
/// payload, then the checksum, then the payload's structure.
pub fn read_record(bytes: &[u8]) -> Result<Option<(Record<'_>, usize)>, FormatError> {
    let Some(&tag) = bytes.first() else {
        return Ok(None);
    };
    if ![BLOCK, ENTRY, END].contains(&tag) {
        return Err(FormatError::Tag(tag));
    }
    let Some(length) = bytes.get(1..5).map(be32) else {
        return Ok(None);
    };
    let payload_len = length as usize;
    if payload_len > MAX_PAYLOAD {
        return Err(FormatError::Length(length));
    }
    let total = RECORD_OVERHEAD + payload_len;
    let Some(record) = bytes.get(..total) else {
        return Ok(None);
    };
    let (body, crc) = record.split_at(total - 4);
    if crc32(body) != be32(crc) {
        return Err(FormatError::Checksum);
    }
    let payload = &body[5..];
    let record = match tag {
        BLOCK => Record::Block(
            std::str::from_utf8(payload).map_err(|_| FormatError::Malformed("block"))?,
        ),
        ENTRY => entry(payload).ok_or(FormatError::Malformed("entry"))?,
        _ => Record::End {
            entries: payload
                .try_into()
                .map(u64::from_be_bytes)
                .map_err(|_| FormatError::Malformed("end"))?,
        },
    };
    Ok(Some((record, total)))
}

fn entry(payload: &[u8]) -> Option<Record<'_>> {
    let age = u64::from_be_bytes(payload.get(..8)?.try_into().ok()?);
    let flags = *payload.get(8)?;
    let key_len = usize::from(u16::from_be_bytes(payload.get(9..11)?.try_into().ok()?));
    let key = payload.get(11..11 + key_len)?;
    let reply = payload.get(11 + key_len..)?;
    (flags & !HOT == 0).then_some(Record::Entry {
        age: Duration::from_millis(age),
        hot: flags & HOT != 0,
        key,
        reply,
    })
}

fn be32(bytes: &[u8]) -> u32 {
    bytes.try_into().map(u32::from_be_bytes).unwrap_or_default()
}

/// CRC-32 (IEEE 802.3, the one of zlib and gzip): reflected, polynomial 0xEDB88320.
pub fn crc32(bytes: &[u8]) -> u32 {
    !bytes.iter().fold(!0u32, |crc, &b| {
        CRC_TABLE[usize::from((crc as u8) ^ b)] ^ (crc >> 8)
    })
}

const CRC_TABLE: [u32; 256] = {
    let mut table = [0u32; 256];
    let mut i = 0;
    while i < 256 {
        let mut c = i as u32;
        let mut k = 0;
        while k < 8 {
            c = if c & 1 != 0 {
                0xEDB8_8320 ^ (c >> 1)
            } else {
                c >> 1
            };
            k += 1;
        }
        table[i] = c;
        i += 1;
    }
    table
};

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn crc32_is_zlibs() {
        // The check value of CRC-32/ISO-HDLC.
        assert_eq!(crc32(b"123456789"), 0xCBF4_3926);
        assert_eq!(crc32(b""), 0);
    }

    fn all_records() -> Vec<Record<'static>> {
        vec![
            Record::Block("zones=. listen=127.0.0.1:53 forward=10.0.0.1:53"),
            Record::Entry {
                age: Duration::from_millis(12_345),
                hot: true,
                key: b"\x03www\x00\x00\x01\x00\x01\x00",
                reply: b"reply bytes",
            },
            Record::Entry {
                age: Duration::ZERO,
                hot: false,
                key: b"",
                reply: b"",
            },
            Record::End { entries: 2 },
        ]
    }

    #[test]
    fn records_read_back_as_written_and_wait_for_their_last_byte() {
        let mut bytes = header(1_700_000_000_000).to_vec();
        for record in all_records() {
            write_record(&mut bytes, &record);
        }
        assert_eq!(read_header(&bytes), Ok(Some(1_700_000_000_000)));
        for cut in 0..HEADER_LEN {
            assert_eq!(read_header(&bytes[..cut]), Ok(None), "{cut}");
        }
        let mut at = HEADER_LEN;
        for expected in all_records() {
            let rest = &bytes[at..];
            let (record, used) = read_record(rest).unwrap().unwrap();
            assert_eq!(record, expected);
            for cut in 0..used {
                assert_eq!(
                    read_record(&rest[..cut]),
                    Ok(None),
                    "{expected:?} cut at {cut}"
                );
            }
            at += used;
        }
        assert_eq!(at, bytes.len());
    }

    #[test]
    fn any_flipped_bit_is_caught() {
        let mut bytes = header(42).to_vec();
        for record in all_records() {
            write_record(&mut bytes, &record);
        }
        for i in 0..bytes.len() {
            for bit in 0..8 {
                let mut bad = bytes.clone();
                bad[i] ^= 1 << bit;
                let mut at = match read_header(&bad) {
                    Ok(Some(_)) => HEADER_LEN,
                    Err(_) => continue,
                    Ok(None) => panic!("a whole header"),
                };
                let mut caught = false;
                while at < bad.len() {
                    match read_record(&bad[at..]) {
                        Ok(Some((_, used))) => at += used,
                        // A length made larger: the record never completes.
                        Ok(None) | Err(_) => {
                            caught = true;
                            break;
                        }
                    }
                }
                assert!(caught, "bit {bit} of byte {i} went unnoticed");
            }
        }
    }

    #[test]
    fn what_is_not_a_carried_cache_is_refused_early() {
        assert_eq!(read_header(b"GET / HTTP/1.1"), Err(FormatError::Magic));
        let mut other = header(0);
        other[15] = 2;
        let crc = crc32(&other[..24]);
        other[24..].copy_from_slice(&crc.to_be_bytes());
        assert_eq!(read_header(&other), Err(FormatError::Version(2)));
        assert_eq!(read_record(b"X\0\0\0\0"), Err(FormatError::Tag(b'X')));
        // A huge length is refused before its payload is waited for.
        assert_eq!(
            read_record(b"E\xff\xff\xff\xff"),
            Err(FormatError::Length(u32::MAX))
        );
        let mut bad_flags = Vec::new();
        write_record(
            &mut bad_flags,
            &Record::Entry {
                age: Duration::ZERO,
                hot: false,
                key: b"k",
                reply: b"r",
            },
        );
        bad_flags[5 + 8] = 0x80;
        let n = bad_flags.len();
        let crc = crc32(&bad_flags[..n - 4]);
        bad_flags[n - 4..].copy_from_slice(&crc.to_be_bytes());
        assert_eq!(
            read_record(&bad_flags),
            Err(FormatError::Malformed("entry"))
        );
    }
}
