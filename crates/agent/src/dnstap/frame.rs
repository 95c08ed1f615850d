//! Frame Streams (the farsightsec "Frame Streams Protocol"), the transport dnstap rides on, as
//! the bidirectional writer of a socket:
//!
//! ```text
//! writer                         reader
//!   READY (content types) ──────>
//!         <────── ACCEPT (the content type it takes)
//!   START (content type) ───────>
//!   data frame … data frame ────>   each: u32 length (big endian, not 0), the payload
//!   STOP ───────────────────────>
//!         <────── FINISH
//! ```
//!
//! A control frame is an escape (u32 0), the control frame's length (u32), its type (u32), then
//! fields: a field type (u32, 1 = content type), a length (u32) and the bytes.

use std::io::{self, Read, Write};

/// The content type of dnstap payloads.
pub const CONTENT_TYPE: &[u8] = b"protobuf:dnstap.Dnstap";

/// Control frame types.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Control {
    Accept = 1,
    Start = 2,
    Stop = 3,
    Ready = 4,
    Finish = 5,
}

impl Control {
    fn from_u32(v: u32) -> Option<Control> {
        Some(match v {
            1 => Control::Accept,
            2 => Control::Start,
            3 => Control::Stop,
            4 => Control::Ready,
            5 => Control::Finish,
            _ => return None,
        })
    }
}

const FIELD_CONTENT_TYPE: u32 = 1;
/// Longest control frame read: a reader's ACCEPT lists a few content types.
const MAX_CONTROL: usize = 512;

/// Writes a control frame of `kind` naming `content_types`.
pub fn write_control(w: &mut impl Write, kind: Control, content_types: &[&[u8]]) -> io::Result<()> {
    let body: usize = 4 + content_types.iter().map(|t| 8 + t.len()).sum::<usize>();
    let mut frame = Vec::with_capacity(8 + body);
    frame.extend_from_slice(&0u32.to_be_bytes());
    frame.extend_from_slice(&(body as u32).to_be_bytes());
    frame.extend_from_slice(&(kind as u32).to_be_bytes());
    for t in content_types {
        frame.extend_from_slice(&FIELD_CONTENT_TYPE.to_be_bytes());
        frame.extend_from_slice(&(t.len() as u32).to_be_bytes());
        frame.extend_from_slice(t);
    }
    w.write_all(&frame)
}

/// Reads one control frame: its type and content types.
pub fn read_control(r: &mut impl Read) -> io::Result<(Control, Vec<Vec<u8>>)> {
    let bad = |what: &str| io::Error::new(io::ErrorKind::InvalidData, what.to_owned());
    let mut word = [0u8; 4];
    r.read_exact(&mut word)?;
    if u32::from_be_bytes(word) != 0 {
        return Err(bad("expected a control frame, got a data frame"));
    }
    r.read_exact(&mut word)?;
    let len = u32::from_be_bytes(word) as usize;
    if !(4..=MAX_CONTROL).contains(&len) {
        return Err(bad("control frame length out of range"));
    }
    let mut body = vec![0u8; len];
    r.read_exact(&mut body)?;
    let kind = Control::from_u32(u32::from_be_bytes(body[..4].try_into().unwrap_or_default()))
        .ok_or_else(|| bad("unknown control frame type"))?;
    let mut types = Vec::new();
    let mut rest = &body[4..];
    while !rest.is_empty() {
        let (Some(field), Some(flen)) = (rest.get(..4), rest.get(4..8)) else {
            return Err(bad("truncated control field"));
        };
        let field = u32::from_be_bytes(field.try_into().unwrap_or_default());
        let flen = u32::from_be_bytes(flen.try_into().unwrap_or_default()) as usize;
        let value = rest
            .get(8..8 + flen)
            .ok_or_else(|| bad("truncated control field"))?;
        if field == FIELD_CONTENT_TYPE {
            types.push(value.to_vec());
        }
        rest = &rest[8 + flen..];
    }
    Ok((kind, types))
}

/// Appends one data frame holding `payload`.
pub fn data(out: &mut Vec<u8>, payload: &[u8]) {
    out.extend_from_slice(&(payload.len() as u32).to_be_bytes());
    out.extend_from_slice(payload);
}

/// The writer's side of the opening: READY, the reader's ACCEPT (which must take dnstap), START.
pub fn open(stream: &mut (impl Read + Write)) -> io::Result<()> {
    write_control(stream, Control::Ready, &[CONTENT_TYPE])?;
    stream.flush()?;
    match read_control(stream)? {
        (Control::Accept, types) if types.is_empty() || types.iter().any(|t| t == CONTENT_TYPE) => {
        }
        (Control::Accept, _) => {
            return Err(io::Error::new(
                io::ErrorKind::InvalidData,
                "the reader does not accept protobuf:dnstap.Dnstap",
            ));
        }
        (other, _) => {
            return Err(io::Error::new(
                io::ErrorKind::InvalidData,
                format!("expected ACCEPT, got {other:?}"),
            ));
        }
    }
    write_control(stream, Control::Start, &[CONTENT_TYPE])?;
    stream.flush()
}

/// The writer's side of the closing: STOP, then the reader's FINISH.
pub fn close(stream: &mut (impl Read + Write)) -> io::Result<()> {
    write_control(stream, Control::Stop, &[])?;
    stream.flush()?;
    match read_control(stream)? {
        (Control::Finish, _) => Ok(()),
        (other, _) => Err(io::Error::new(
            io::ErrorKind::InvalidData,
            format!("expected FINISH, got {other:?}"),
        )),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::net::UnixStream;

    #[test]
    fn control_frames_round_trip() {
        let mut buf = Vec::new();
        write_control(&mut buf, Control::Ready, &[CONTENT_TYPE, b"x"]).unwrap();
        assert_eq!(&buf[..4], [0, 0, 0, 0], "the escape");
        assert_eq!(
            u32::from_be_bytes(buf[4..8].try_into().unwrap()) as usize,
            buf.len() - 8
        );
        let (kind, types) = read_control(&mut &buf[..]).unwrap();
        assert_eq!(kind, Control::Ready);
        assert_eq!(types, [CONTENT_TYPE.to_vec(), b"x".to_vec()]);
    }

    #[test]
    fn garbage_is_an_error_not_a_panic() {
        for bad in [
            &[0, 0, 0, 1][..],
            &[0, 0, 0, 0, 0, 0, 0, 2],
            &[0, 0, 0, 0, 0, 0, 0, 4, 0, 0, 0, 9],
            &[0, 0, 0, 0, 0, 0, 0, 12, 0, 0, 0, 1, 0, 0, 0, 1, 0, 0, 0, 99],
            &[0, 0, 0, 0, 0xff, 0xff, 0xff, 0xff],
        ] {
            assert!(read_control(&mut &bad[..]).is_err(), "{bad:?}");
        }
    }

    #[test]
    fn the_bidirectional_handshake_opens_and_closes() {
        let (mut writer, mut reader) = UnixStream::pair().unwrap();
        let far = std::thread::spawn(move || {
            let (kind, types) = read_control(&mut reader).unwrap();
            assert_eq!((kind, types), (Control::Ready, vec![CONTENT_TYPE.to_vec()]));
            write_control(&mut reader, Control::Accept, &[CONTENT_TYPE]).unwrap();
            assert_eq!(read_control(&mut reader).unwrap().0, Control::Start);
            let mut len = [0u8; 4];
            reader.read_exact(&mut len).unwrap();
            let mut payload = vec![0u8; u32::from_be_bytes(len) as usize];
            reader.read_exact(&mut payload).unwrap();
            assert_eq!(read_control(&mut reader).unwrap().0, Control::Stop);
            write_control(&mut reader, Control::Finish, &[]).unwrap();
            payload
        });
        open(&mut writer).unwrap();
        let mut frame = Vec::new();
        data(&mut frame, b"hello");
        writer.write_all(&frame).unwrap();
        close(&mut writer).unwrap();
        assert_eq!(far.join().unwrap(), b"hello");
    }

    #[test]
    fn a_reader_that_takes_another_content_type_is_refused() {
        let (mut writer, mut reader) = UnixStream::pair().unwrap();
        let far = std::thread::spawn(move || {
            read_control(&mut reader).unwrap();
            write_control(&mut reader, Control::Accept, &[b"protobuf:other"]).unwrap();
        });
        assert!(open(&mut writer).is_err());
        far.join().unwrap();
    }
}
