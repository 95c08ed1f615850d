//! A TCP byte stream cut into frames: `frame::split` never panics, consumes exactly the prefix
//! and message length, and every frame goes through both parsers.
#![no_main]

use libfuzzer_sys::fuzz_target;
use nodedns_wire::{Query, Reply, frame};

fuzz_target!(|data: &[u8]| {
    let mut rest = data;
    while let Ok(Some((message, consumed))) = frame::split(rest) {
        assert_eq!(consumed, message.len() + 2);
        assert!(message.len() >= 12);
        let _ = Query::parse(message);
        let _ = Reply::parse(message);
        rest = &rest[consumed..];
    }
});
