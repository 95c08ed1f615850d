//! The fixed 12-byte header of any message (RFC 1035 §4.1.1), for code that handles whole
//! messages without parsing them: the upstream pool matches replies by ID, the metrics and the
//! query log read the RCODE, the loop check reads the RCODE of its probe's answer.

use crate::octets::{get16, header, set16};
use crate::{HEADER_LEN, flags};

/// A message's header, copied out of it.
#[derive(Clone, Copy, PartialEq, Eq)]
pub struct Header([u8; HEADER_LEN]);

impl Header {
    /// The header of `msg`, or `None` if `msg` is shorter than a header.
    pub fn read(msg: &[u8]) -> Option<Header> {
        let bytes = msg.get(..HEADER_LEN)?;
        let mut header = [0u8; HEADER_LEN];
        header.copy_from_slice(bytes);
        Some(Header(header))
    }

    fn get(&self, at: usize) -> u16 {
        // Every offset read here is a field of the 12 bytes held.
        get16(&self.0, at).unwrap_or(0)
    }

    pub fn id(&self) -> u16 {
        self.get(header::ID)
    }

    /// The 16-bit flags word (QR, opcode, AA, TC, RD, RA, Z, AD, CD, RCODE): see [`crate::flags`].
    pub fn flags(&self) -> u16 {
        self.get(header::FLAGS)
    }

    /// QR: the message is a response.
    pub fn is_response(&self) -> bool {
        self.flags() & flags::QR != 0
    }

    /// TC: the sender cut the message short (RFC 2181 §9); over UDP, ask again over TCP
    /// (RFC 7766 §5).
    pub fn truncated(&self) -> bool {
        self.flags() & flags::TC != 0
    }

    /// The header's 4-bit RCODE. An extended RCODE also has 8 upper bits in the OPT record
    /// (RFC 6891 §6.1.3), which this does not read.
    pub fn rcode(&self) -> u8 {
        // The mask keeps 4 bits.
        (self.flags() & flags::RCODE_MASK) as u8
    }

    pub fn qdcount(&self) -> u16 {
        self.get(header::QDCOUNT)
    }

    pub fn ancount(&self) -> u16 {
        self.get(header::ANCOUNT)
    }

    pub fn nscount(&self) -> u16 {
        self.get(header::NSCOUNT)
    }

    pub fn arcount(&self) -> u16 {
        self.get(header::ARCOUNT)
    }
}

impl std::fmt::Debug for Header {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Header")
            .field("id", &self.id())
            .field("flags", &format_args!("{:#06x}", self.flags()))
            .field("qdcount", &self.qdcount())
            .field("ancount", &self.ancount())
            .field("nscount", &self.nscount())
            .field("arcount", &self.arcount())
            .finish()
    }
}

/// Overwrites the message ID of `msg`; does nothing if `msg` is shorter than a header.
pub fn set_id(msg: &mut [u8], id: u16) {
    if msg.len() >= HEADER_LEN {
        set16(msg, header::ID, id);
    }
}

#[cfg(test)]
mod tests {
    use hickory_proto::op::{Message, MessageType, OpCode, ResponseCode};

    use super::*;

    #[test]
    fn fields_read_as_hickory_wrote_them() {
        let mut msg = Message::response(0xbeef, OpCode::Query);
        msg.metadata.message_type = MessageType::Response;
        msg.metadata.truncation = true;
        msg.metadata.response_code = ResponseCode::NXDomain;
        msg.add_query(hickory_proto::op::Query::query(
            crate::testutil::name("example."),
            hickory_proto::rr::RecordType::A,
        ));
        let bytes = msg.to_vec().unwrap();
        let header = Header::read(&bytes).unwrap();
        assert_eq!(header.id(), 0xbeef);
        assert!(header.is_response());
        assert!(header.truncated());
        assert_eq!(header.rcode(), crate::rcode::NXDOMAIN);
        assert_eq!(
            (
                header.qdcount(),
                header.ancount(),
                header.nscount(),
                header.arcount()
            ),
            (1, 0, 0, 0)
        );
    }

    #[test]
    fn a_query_is_not_a_response_and_not_truncated() {
        let mut msg = Message::query();
        msg.metadata.id = 7;
        let header = Header::read(&msg.to_vec().unwrap()).unwrap();
        assert!(!header.is_response());
        assert!(!header.truncated());
        assert_eq!(header.rcode(), 0);
    }

    #[test]
    fn the_rcode_is_the_low_four_bits_only() {
        let mut bytes = [0u8; HEADER_LEN];
        bytes[3] = 0xfb; // RA, Z, AD, CD set; RCODE 11
        assert_eq!(Header::read(&bytes).unwrap().rcode(), 11);
    }

    #[test]
    fn short_messages_have_no_header_and_keep_their_bytes() {
        for len in 0..HEADER_LEN {
            let mut bytes = vec![0xaa; len];
            assert_eq!(Header::read(&bytes), None);
            set_id(&mut bytes, 0x1234);
            assert!(bytes.iter().all(|&b| b == 0xaa), "{len} bytes changed");
        }
    }

    #[test]
    fn set_id_changes_the_id_only() {
        let mut bytes: Vec<u8> = (0..20).collect();
        set_id(&mut bytes, 0xabcd);
        assert_eq!(Header::read(&bytes).unwrap().id(), 0xabcd);
        assert_eq!(bytes[2..], (2..20).collect::<Vec<u8>>()[..]);
    }
}
