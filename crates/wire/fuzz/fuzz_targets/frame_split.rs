//! A TCP byte stream (the input) cut into frames, as both TCP readers cut theirs (the agent's
//! client connections, the upstream pool's connections): `frame::split` never panics and consumes
//! exactly the prefix and message length; `frame::Buffer`, fed the stream in reads of several
//! sizes (a byte at a time up to more than a frame), never panics, always has room while no whole
//! frame is buffered, and hands out exactly the frames `split` finds in the whole stream, in
//! order, stopping at the first frame too short for a header. Every frame goes through both
//! parsers.
#![no_main]

use libfuzzer_sys::fuzz_target;
use nodedns_wire::{Query, Reply, frame};

/// Sizes of the reads the stream is fed to a buffer in.
const READ_SIZES: [usize; 6] = [1, 2, 13, 100, 512, frame::MAX_FRAME + 1];

fuzz_target!(|stream: &[u8]| {
    // What the whole stream holds, by `split` alone.
    let mut expected = Vec::new();
    let mut rest = stream;
    let mut malformed = false;
    loop {
        match frame::split(rest) {
            Ok(Some((message, consumed))) => {
                assert_eq!(consumed, message.len() + 2);
                assert!(message.len() >= 12);
                let _ = Query::parse(message);
                let _ = Reply::parse(message);
                expected.push(message);
                rest = &rest[consumed..];
            }
            Ok(None) => break,
            Err(_) => {
                malformed = true;
                break;
            }
        }
    }

    for read_size in READ_SIZES {
        let mut buffer = frame::Buffer::new(64);
        let mut taken = 0;
        let mut at = 0;
        loop {
            match buffer.ready() {
                Ok(true) => {
                    let message = buffer.take().expect("a whole frame is buffered");
                    assert_eq!(message, expected[taken]);
                    taken += 1;
                    continue;
                }
                Err(_) => {
                    assert!(malformed);
                    break;
                }
                Ok(false) => {}
            }
            if at == stream.len() {
                break;
            }
            let room = buffer.spare();
            assert!(!room.is_empty());
            let n = room.len().min(read_size).min(stream.len() - at);
            room[..n].copy_from_slice(&stream[at..at + n]);
            buffer.filled(n);
            at += n;
            assert!(buffer.capacity() <= frame::MAX_FRAME);
        }
        assert_eq!(taken, expected.len());
    }
});
