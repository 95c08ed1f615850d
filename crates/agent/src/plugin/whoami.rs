//! `whoami`: tells the client its own address, port and transport, as CoreDNS's
//! `plugin/whoami` does.
//!
//! - Configuration ([`parse`]): `whoami`, no argument, no block.
//! - Logic ([`Whoami::answer`]): NOERROR, AA, no answer record; the additional section holds
//!   `<qname> 0 IN A <client address>` (AAAA for an IPv6 client) and
//!   `_<udp|tcp>.<qname> 0 IN SRV 0 0 <client port> .`.
//! - Place in the chain: after `forward`, so it answers only what the block's `forward` does not
//!   take (in a block with `forward .`, never).
//! - Unlike every other answer after the cache, its reply is not stored in the block's cache:
//!   it holds the address of the client that asked, which a cached copy would give to the next
//!   client (CoreDNS's cache would store it for 5 s).
//! - No metrics of its own (CoreDNS's has none).

use std::net::{IpAddr, SocketAddr};

use hickory_proto::rr::rdata::{A, AAAA, SRV};
use hickory_proto::rr::{DNSClass, Name, RData, Record};

use super::{Request, Step};
use crate::config::corefile::Directive;
use crate::config::directives::Out;
use crate::metrics::Plugin;
use crate::serve::Proto;

/// A `whoami` directive (it takes no setting).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Whoami;

/// Reads a `whoami` directive.
pub(crate) fn parse(d: &Directive, out: &mut Out<'_>) -> Option<Whoami> {
    out.no_block(d, "whoami");
    out.arity(d, "whoami", 0, 0, "whoami").then_some(Whoami)
}

impl Whoami {
    /// CoreDNS's `Whoami.ServeDNS` for a query from `client`.
    pub fn answer(&self, request: &Request<'_>, client: (SocketAddr, Proto)) -> Step {
        let (addr, proto) = client;
        // The name as the client wrote it, as CoreDNS's `state.QName()`.
        let Some(owner) = super::name(request.query.qname()) else {
            return Step::ServFail;
        };
        let class = DNSClass::from(request.key.qclass());
        let mut address = Record::from_rdata(
            owner.clone(),
            0,
            match addr.ip() {
                IpAddr::V4(v4) => RData::A(A(v4)),
                IpAddr::V6(v6) => RData::AAAA(AAAA(v6)),
            },
        );
        address.dns_class = class;
        let label = match proto {
            Proto::Udp => "_udp",
            Proto::Tcp => "_tcp",
        };
        let Ok(service) = Name::from_ascii(label).and_then(|l| l.append_domain(&owner)) else {
            return Step::ServFail;
        };
        let mut srv = Record::from_rdata(
            service,
            0,
            RData::SRV(SRV::new(0, 0, addr.port(), Name::root())),
        );
        srv.dns_class = class;
        match super::reply(request, true, Vec::new(), vec![address, srv]) {
            Some(reply) => Step::Answer {
                reply,
                by: Plugin::Whoami,
                cache: false,
            },
            None => Step::ServFail,
        }
    }
}

#[cfg(test)]
mod tests {
    use hickory_proto::op::Message;
    use hickory_proto::rr::RecordType;

    use super::*;

    fn ask(name: &str, client: &str, proto: Proto) -> Message {
        let mut query = Message::query();
        query.add_query(hickory_proto::op::Query::query(
            Name::from_ascii(name).unwrap(),
            RecordType::A,
        ));
        let bytes = query.to_vec().unwrap();
        let query = nodedns_wire::Query::parse(&bytes).unwrap();
        let key = query.key();
        let request = Request {
            query: &query,
            key: &key,
            client: None,
        };
        match Whoami.answer(&request, (client.parse().unwrap(), proto)) {
            Step::Answer { reply, by, cache } => {
                assert_eq!(by, Plugin::Whoami);
                assert!(!cache, "the client's own address is never cached");
                Message::from_vec(&reply).unwrap()
            }
            other => panic!("{other:?}"),
        }
    }

    fn additional(m: &Message) -> Vec<String> {
        m.additionals
            .iter()
            .map(|r| format!("{} {} {}", r.name, r.ttl, r.data))
            .collect()
    }

    #[test]
    fn the_client_gets_its_address_and_port_in_the_additional_section() {
        let m = ask("Anything.Example.", "169.254.20.10:40053", Proto::Udp);
        assert!(m.metadata.authoritative && m.answers.is_empty());
        assert_eq!(
            additional(&m),
            [
                "Anything.Example. 0 169.254.20.10",
                "_udp.Anything.Example. 0 0 0 40053 .",
            ]
        );
        let m = ask(".", "[fd00::1]:5353", Proto::Tcp);
        assert_eq!(additional(&m), [". 0 fd00::1", "_tcp. 0 0 0 5353 ."]);
    }
}
