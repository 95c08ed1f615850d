//! DNS over TCP: every message is preceded by its length as a 16-bit big-endian integer
//! (RFC 1035 §4.2.2). A decoder with no I/O, so the same code serves client connections and
//! upstream connections, and can be fuzzed.

/// Splits the first complete frame off the front of `buf`.
///
/// Returns `Ok(Some((message, consumed)))` when `buf` starts with a whole frame,
/// `Ok(None)` when more bytes are needed, and `Err` for a frame that can never be valid
/// (length below the 12-byte header: RFC 7766 §8 lets the server close the connection).
pub fn split(buf: &[u8]) -> Result<Option<(&[u8], usize)>, FrameError> {
    let _ = buf;
    todo!()
}

/// A frame that can never hold a DNS message.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[error("TCP frame of {0} bytes is shorter than a DNS header")]
pub struct FrameError(pub u16);
