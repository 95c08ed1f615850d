//! DNS over TCP: every message is preceded by its length as a 16-bit big-endian integer
//! (RFC 1035 §4.2.2).
//!
//! Both TCP readers of nodedns cut their streams with this code: the agent's client connections
//! (pipelined queries) and the upstream pool's connections to CoreDNS (one reply per query).
//! Each keeps a [`Buffer`], reads into [`Buffer::spare`] until [`Buffer::ready`], and takes the
//! message with [`Buffer::take`]; [`split`] is the rule underneath. No I/O here, so the framing
//! is the same for any stream (TCP, TLS, an in-memory pipe in tests) and can be fuzzed.

use std::fmt;

use crate::HEADER_LEN;
use crate::octets::get16;

/// The largest frame: the length prefix and a 65535-byte message.
pub const MAX_FRAME: usize = 2 + u16::MAX as usize;

/// Splits the first complete frame off the front of `buf`.
///
/// Returns `Ok(Some((message, consumed)))` when `buf` starts with a whole frame,
/// `Ok(None)` when more bytes are needed, and `Err` for a frame that can never be valid
/// (length below the 12-byte header: RFC 7766 §8 lets the server close the connection).
pub fn split(buf: &[u8]) -> Result<Option<(&[u8], usize)>, FrameError> {
    let Some(len) = get16(buf, 0) else {
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

/// The bytes a TCP reader has read and not consumed yet, and the room for its next read.
///
/// A read may bring part of a frame or several frames at once; the buffer keeps what is left
/// for the next [`Buffer::take`]. It grows only to hold a whole frame (at most [`MAX_FRAME`]
/// bytes, once the frame's length prefix says so) and never shrinks: after warm-up, reading
/// and taking frames allocates nothing. Each message is handed out in place, without a copy.
pub struct Buffer {
    /// `start..end` is read and not taken; `end..` is room. Always initialized (zeroed when it
    /// grows), so the room is handed out as a plain slice.
    bytes: Vec<u8>,
    start: usize,
    end: usize,
}

impl Buffer {
    /// A buffer with room for `capacity` bytes (at least a length prefix and a header, at most
    /// [`MAX_FRAME`]) before it first grows.
    pub fn new(capacity: usize) -> Buffer {
        Buffer {
            bytes: vec![0; capacity.clamp(2 + HEADER_LEN, MAX_FRAME)],
            start: 0,
            end: 0,
        }
    }

    fn pending(&self) -> &[u8] {
        self.bytes.get(self.start..self.end).unwrap_or_default()
    }

    /// Whether a whole frame is buffered (then [`Buffer::take`] returns it). `Err` once the
    /// next frame's length prefix is below a header's size: the stream can never be valid again.
    pub fn ready(&self) -> Result<bool, FrameError> {
        split(self.pending()).map(|frame| frame.is_some())
    }

    /// Consumes the next whole frame and returns its message, or `None` (consuming nothing) if
    /// no whole, valid frame is buffered.
    pub fn take(&mut self) -> Option<&[u8]> {
        let Ok(Some((_, consumed))) = split(self.pending()) else {
            return None;
        };
        let at = self.start;
        self.start += consumed;
        if self.start == self.end {
            // Everything read is taken: the next read starts at the front, with no copy. The
            // message stays where it is until the next call to `spare`, which the borrow
            // returned here rules out.
            self.start = 0;
            self.end = 0;
        }
        self.bytes.get(at + 2..at + consumed)
    }

    /// The room for the next read: never empty unless a whole frame is buffered (read only while
    /// [`Buffer::ready`] is false). Makes room for the whole of the next frame once its length is
    /// known, moving its first bytes to the front or growing the buffer when it would not fit.
    pub fn spare(&mut self) -> &mut [u8] {
        let pending = self.end - self.start;
        // What the next frame needs in all: its length prefix, then its message once the prefix
        // is known.
        let need = match get16(self.pending(), 0) {
            Some(len) => 2 + usize::from(len),
            None => 2,
        };
        if self.start + need > self.bytes.len() {
            self.bytes.copy_within(self.start..self.end, 0);
            self.start = 0;
            self.end = pending;
            if need > self.bytes.len() {
                self.bytes.resize(need, 0);
            }
        }
        self.bytes.get_mut(self.end..).unwrap_or_default()
    }

    /// Records that the last read put `n` bytes at the start of [`Buffer::spare`].
    pub fn filled(&mut self, n: usize) {
        self.end = self.end.saturating_add(n).min(self.bytes.len());
    }

    /// The length of the next frame's message, once its length prefix is buffered (so a reader
    /// can refuse a frame longer than it accepts before reading it whole).
    pub fn next_len(&self) -> Option<usize> {
        get16(self.pending(), 0).map(usize::from)
    }

    /// Whether no byte is buffered: nothing of a next frame has been read. A stream that ends
    /// here ended cleanly, between frames.
    pub fn is_empty(&self) -> bool {
        self.start == self.end
    }

    /// Bytes the buffer holds room for (it grows past its initial capacity for larger frames).
    pub fn capacity(&self) -> usize {
        self.bytes.len()
    }
}

impl fmt::Debug for Buffer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Buffer")
            .field("buffered", &(self.end - self.start))
            .field("capacity", &self.bytes.len())
            .finish()
    }
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

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

    /// `n` bytes of `stream` into `buffer`, as one read would put them; returns how many fit.
    fn read(buffer: &mut Buffer, stream: &[u8]) -> usize {
        let room = buffer.spare();
        let n = room.len().min(stream.len());
        room[..n].copy_from_slice(&stream[..n]);
        buffer.filled(n);
        n
    }

    fn frame(message: &[u8]) -> Vec<u8> {
        let mut out = (message.len() as u16).to_be_bytes().to_vec();
        out.extend_from_slice(message);
        out
    }

    #[test]
    fn pipelined_frames_read_at_once_are_taken_one_by_one() {
        let (a, b) = ([1u8; 12], [2u8; 30]);
        let mut stream = frame(&a);
        stream.extend(frame(&b));
        let mut buffer = Buffer::new(512);
        assert_eq!(read(&mut buffer, &stream), stream.len());
        assert_eq!(buffer.ready(), Ok(true));
        assert_eq!(buffer.take(), Some(&a[..]));
        assert_eq!(buffer.take(), Some(&b[..]));
        assert_eq!(buffer.take(), None);
        assert!(buffer.is_empty());
        assert_eq!(buffer.ready(), Ok(false));
    }

    #[test]
    fn a_frame_dripped_byte_by_byte_is_whole_only_at_its_last_byte() {
        let message: Vec<u8> = (0..40).collect();
        let stream = frame(&message);
        let mut buffer = Buffer::new(16);
        for (i, byte) in stream.iter().enumerate() {
            assert_eq!(buffer.ready(), Ok(false), "after {i} bytes");
            assert_eq!(buffer.take(), None);
            assert_eq!(read(&mut buffer, std::slice::from_ref(byte)), 1);
            assert!(!buffer.is_empty());
        }
        assert_eq!(buffer.take(), Some(&message[..]));
        assert!(buffer.is_empty());
    }

    #[test]
    fn a_frame_larger_than_the_buffer_grows_it_once_and_later_ones_reuse_it() {
        let big = vec![9u8; 3000];
        let mut buffer = Buffer::new(64);
        let stream = [frame(&big), frame(&big)].concat();
        let mut at = 0;
        let mut taken = 0;
        while taken < 2 {
            if buffer.ready() == Ok(true) {
                assert_eq!(buffer.take(), Some(&big[..]));
                taken += 1;
                continue;
            }
            at += read(&mut buffer, &stream[at..]);
        }
        assert_eq!(at, stream.len());
        assert_eq!(buffer.capacity(), big.len() + 2);
    }

    #[test]
    fn a_partial_frame_behind_a_whole_one_moves_to_the_front() {
        // 14 bytes of room: the first frame fills it, the second starts in the next read.
        let mut buffer = Buffer::new(14);
        let (a, b) = ([1u8; 12], [2u8; 12]);
        let stream = [frame(&a), frame(&b)].concat();
        assert_eq!(read(&mut buffer, &stream), 14);
        assert_eq!(buffer.take(), Some(&a[..]));
        assert_eq!(read(&mut buffer, &stream[14..]), 14);
        assert_eq!(buffer.take(), Some(&b[..]));
        assert_eq!(buffer.capacity(), 14, "no growth for frames that fit");
    }

    #[test]
    fn the_next_frames_length_is_known_from_its_prefix_before_its_message() {
        let mut buffer = Buffer::new(64);
        assert_eq!(buffer.next_len(), None);
        read(&mut buffer, &[0x10]);
        assert_eq!(buffer.next_len(), None, "half a prefix");
        read(&mut buffer, &[0x00, 1, 2]);
        assert_eq!(buffer.next_len(), Some(0x1000));
        assert_eq!(
            buffer.capacity(),
            64,
            "nothing grown for a length only read"
        );
    }

    #[test]
    fn a_short_frame_is_an_error_and_is_never_taken() {
        let mut buffer = Buffer::new(64);
        read(&mut buffer, &[0, 5, 1, 2, 3, 4, 5]);
        assert_eq!(buffer.ready(), Err(FrameError(5)));
        assert_eq!(buffer.take(), None);
        assert!(!buffer.spare().is_empty());
    }

    #[test]
    fn the_largest_frame_fits() {
        let message = vec![7u8; 65535];
        let stream = frame(&message);
        let mut buffer = Buffer::new(512);
        let mut at = 0;
        while buffer.ready() == Ok(false) {
            at += read(&mut buffer, &stream[at..]);
        }
        assert_eq!(buffer.take().map(<[u8]>::len), Some(65535));
        assert_eq!(buffer.capacity(), MAX_FRAME);
    }

    #[test]
    fn after_warm_up_reading_and_taking_allocate_nothing() {
        let stream: Vec<u8> = (0..50u8).flat_map(|i| frame(&[i; 40])).collect();
        let mut buffer = Buffer::new(128);
        let drain = |buffer: &mut Buffer| {
            let mut at = 0;
            let mut frames = 0;
            while frames < 50 {
                match buffer.take() {
                    Some(message) => {
                        assert_eq!(message, &[frames as u8; 40]);
                        frames += 1;
                    }
                    None => at += read(buffer, &stream[at..]),
                }
            }
        };
        drain(&mut buffer);
        let info = allocation_counter::measure(|| drain(&mut buffer));
        assert_eq!(info.count_total, 0);
    }

    proptest! {
        /// However a stream of frames is cut into reads, the buffer hands out exactly the
        /// frames `split` finds in the whole stream, in order.
        #[test]
        fn any_cut_of_a_stream_yields_the_frames_split_finds(
            messages in prop::collection::vec(prop::collection::vec(any::<u8>(), 12..300), 0..8),
            cuts in prop::collection::vec(1usize..200, 1..40),
            capacity in 0usize..600,
        ) {
            let stream: Vec<u8> = messages.iter().flat_map(|m| frame(m)).collect();
            let mut buffer = Buffer::new(capacity);
            let mut got = Vec::new();
            let mut at = 0;
            let mut cut = cuts.iter().cycle();
            loop {
                while let Some(message) = buffer.take() {
                    got.push(message.to_vec());
                }
                if at == stream.len() {
                    break;
                }
                let room = buffer.spare();
                prop_assert!(!room.is_empty());
                let n = room.len().min(stream.len() - at).min(*cut.next().unwrap());
                room[..n].copy_from_slice(&stream[at..at + n]);
                buffer.filled(n);
                at += n;
            }
            prop_assert!(buffer.is_empty());
            prop_assert_eq!(got, messages);
        }
    }
}
