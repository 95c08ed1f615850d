//! DNS over TCP: every message is preceded by its length as a 16-bit big-endian integer
//! (RFC 1035 §4.2.2). A decoder with no I/O, so the same code serves client connections and
//! upstream connections, and can be fuzzed.

use crate::HEADER_LEN;

/// Splits the first complete frame off the front of `buf`.
///
/// Returns `Ok(Some((message, consumed)))` when `buf` starts with a whole frame,
/// `Ok(None)` when more bytes are needed, and `Err` for a frame that can never be valid
/// (length below the 12-byte header: RFC 7766 §8 lets the server close the connection).
pub fn split(buf: &[u8]) -> Result<Option<(&[u8], usize)>, FrameError> {
    let Some(len) = crate::octets::get16(buf, 0) else {
        return Ok(None);
    };
    if usize::from(len) < HEADER_LEN {
        return Err(FrameError(len));
    }
    let consumed = 2 + usize::from(len);
    Ok(buf.get(2..consumed).map(|message| (message, consumed)))
}

/// A frame that can never hold a DNS message.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[error("TCP frame of {0} bytes is shorter than a DNS header")]
pub struct FrameError(pub u16);

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn needs_more_bytes_until_the_length_prefix_is_complete() {
        assert_eq!(split(&[]), Ok(None));
        assert_eq!(split(&[0]), Ok(None));
    }

    #[test]
    fn needs_more_bytes_until_the_message_is_complete() {
        let mut buf = vec![0, 12];
        buf.extend_from_slice(&[7; 11]);
        assert_eq!(split(&buf), Ok(None));
    }

    #[test]
    fn splits_the_first_frame_and_leaves_the_next() {
        let mut buf = vec![0, 12];
        buf.extend_from_slice(&[1; 12]);
        buf.extend_from_slice(&[0, 13, 2]);
        let (message, consumed) = split(&buf).unwrap().unwrap();
        assert_eq!(message, &[1; 12]);
        assert_eq!(consumed, 14);
        assert_eq!(split(&buf[consumed..]), Ok(None));
    }

    #[test]
    fn frame_shorter_than_a_header_is_an_error() {
        assert_eq!(split(&[0, 11]), Err(FrameError(11)));
        assert_eq!(split(&[0, 0, 1, 2]), Err(FrameError(0)));
    }

    #[test]
    fn largest_frame_is_accepted() {
        let mut buf = vec![0xFF, 0xFF];
        buf.resize(2 + 65535, 0);
        let (message, consumed) = split(&buf).unwrap().unwrap();
        assert_eq!(message.len(), 65535);
        assert_eq!(consumed, 65537);
    }
}
