//! Edits of a message already written for a client, in place: the before-cache directives
//! (`bufsize`, `loadbalance`) change what goes out without re-encoding it.

use crate::HEADER_LEN;
use crate::name;
use crate::octets::{get16, set16};
use crate::{rcode, rtype};

/// Most records of one type and owner in one section that [`rotate_addresses`] rotates; a larger
/// set is left in its order (no allocation on the serving path).
const MAX_ROTATED: usize = 64;

/// Where each record of a message starts: its owner name, and its RDATA (offset, length).
#[derive(Debug, Clone, Copy)]
struct Record {
    owner: (usize, usize),
    rtype: u16,
    rdata: usize,
    rdlen: usize,
}

/// Walks the records of `msg` from `at`, section by section: calls `each(section, record)`.
/// False when the message does not hold what its header announces.
fn walk(msg: &[u8], mut each: impl FnMut(usize, Record)) -> bool {
    let Some(qdcount) = get16(msg, 4) else {
        return false;
    };
    let mut at = HEADER_LEN;
    for _ in 0..qdcount {
        let Ok(end) = name::skip(msg, at) else {
            return false;
        };
        at = end + 4;
    }
    for (section, count_at) in [6usize, 8, 10].into_iter().enumerate() {
        let Some(count) = get16(msg, count_at) else {
            return false;
        };
        for _ in 0..count {
            let Ok(end) = name::skip(msg, at) else {
                return false;
            };
            let (Some(rtype), Some(rdlen)) = (get16(msg, end), get16(msg, end + 8)) else {
                return false;
            };
            let rdata = end + 10;
            let rdlen = usize::from(rdlen);
            if msg.len() < rdata + rdlen {
                return false;
            }
            each(
                section,
                Record {
                    owner: (at, end),
                    rtype,
                    rdata,
                    rdlen,
                },
            );
            at = rdata + rdlen;
        }
    }
    true
}

/// Sets the UDP payload size of the message's OPT record (RFC 6891 §6.1.2: its CLASS field) to
/// `size`. False when it has none.
pub fn set_opt_size(msg: &mut [u8], size: u16) -> bool {
    let mut opt = None;
    walk(msg, |section, r| {
        if section == 2 && r.rtype == rtype::OPT {
            opt = Some(r.rdata - 8);
        }
    });
    match opt {
        Some(class) => {
            set16(msg, class, size);
            true
        }
        None => false,
    }
}

/// How many records of type `rtype` the answer section of `msg` holds (`dns64` asks whether an
/// AAAA answer has AAAA records without decoding it); `None` when the message does not hold
/// what its header announces.
pub fn answers_of_type(msg: &[u8], rtype: u16) -> Option<usize> {
    let mut n = 0;
    walk(msg, |section, r| {
        if section == 0 && r.rtype == rtype {
            n += 1;
        }
    })
    .then_some(n)
}

/// Rotates by `shift` the addresses of every set of A records, and of AAAA records, of one
/// owner in each section of a NOERROR reply: CoreDNS's `loadbalance` round robin, for the
/// record types whose RDATA has a fixed length (RFC 1035 §3.4.1, RFC 3596 §2.2) and holds no
/// name, so moving RDATA between records of one owner changes no offset and no pointer.
///
/// Records of one name written with different owner bytes (one in full, one compressed) are a
/// set only when their owner bytes are equal: such a set is left in its order, never mixed up.
/// Returns how many sets it rotated.
pub fn rotate_addresses(msg: &mut [u8], shift: usize) -> usize {
    if get16(msg, 2).is_none_or(|flags| u8::try_from(flags & 0x000f).ok() != Some(rcode::NOERROR)) {
        return 0;
    }
    let mut rotated = 0;
    for section in 0..3 {
        for (want, len) in [(rtype::A, 4usize), (rtype::AAAA, 16)] {
            let mut at = [0usize; MAX_ROTATED];
            let mut n = 0;
            let mut owner: Option<(usize, usize)> = None;
            let mut same = true;
            let whole = walk(msg, |s, r| {
                if s != section || r.rtype != want || r.rdlen != len {
                    return;
                }
                match owner {
                    None => owner = Some(r.owner),
                    Some((start, end)) => {
                        if msg[start..end] != msg[r.owner.0..r.owner.1] {
                            same = false;
                        }
                    }
                }
                if n < MAX_ROTATED {
                    at[n] = r.rdata;
                }
                n += 1;
            });
            if !whole || !same || !(2..=MAX_ROTATED).contains(&n) {
                continue;
            }
            rotate(msg, &at[..n], len, shift % n);
            rotated += 1;
        }
    }
    rotated
}

/// Rotates left by `by` the `len`-byte fields at `at` (three reversals: no buffer).
fn rotate(msg: &mut [u8], at: &[usize], len: usize, by: usize) {
    let reverse = |msg: &mut [u8], lo: usize, hi: usize| {
        let (mut i, mut j) = (lo, hi);
        while i + 1 < j {
            j -= 1;
            for b in 0..len {
                msg.swap(at[i] + b, at[j] + b);
            }
            i += 1;
        }
    };
    let n = at.len();
    reverse(msg, 0, by);
    reverse(msg, by, n);
    reverse(msg, 0, n);
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A NOERROR reply for `a.example. A` holding `ips` (owners compressed to the question),
    /// then `extra` appended as the additional section's one record, raw.
    fn reply(rcode: u8, ips: &[[u8; 4]], extra: &[u8]) -> Vec<u8> {
        let mut m = vec![0, 7, 0x81, 0x80 | rcode, 0, 1];
        m.extend_from_slice(&u16::try_from(ips.len()).unwrap().to_be_bytes());
        m.extend_from_slice(&[0, 0, 0, u8::from(!extra.is_empty())]);
        m.extend_from_slice(b"\x01a\x07example\x00\x00\x01\x00\x01");
        for ip in ips {
            m.extend_from_slice(&[0xc0, 12, 0, 1, 0, 1, 0, 0, 0, 30, 0, 4]);
            m.extend_from_slice(ip);
        }
        m.extend_from_slice(extra);
        m
    }

    fn addresses(msg: &[u8]) -> Vec<Vec<u8>> {
        let mut out = Vec::new();
        walk(msg, |_, r| {
            if r.rtype == rtype::A {
                out.push(msg[r.rdata..r.rdata + r.rdlen].to_vec());
            }
        });
        out
    }

    const OPT: [u8; 11] = [0, 0, 41, 0x04, 0xd0, 0, 0, 0, 0, 0, 0];

    #[test]
    fn answers_of_a_type_are_counted_in_the_answer_section_only() {
        let two = reply(0, &[[10, 0, 0, 1], [10, 0, 0, 2]], &OPT);
        assert_eq!(answers_of_type(&two, rtype::A), Some(2));
        assert_eq!(answers_of_type(&two, rtype::AAAA), Some(0));
        assert_eq!(
            answers_of_type(&two, rtype::OPT),
            Some(0),
            "OPT is additional"
        );
        assert_eq!(answers_of_type(&two[..two.len() - 3], rtype::A), None);
    }

    #[test]
    fn addresses_rotate_by_the_shift_and_nothing_else_moves() {
        let ips = [[10, 0, 0, 1], [10, 0, 0, 2], [10, 0, 0, 3]];
        let mut msg = reply(0, &ips, &OPT);
        let before = msg.clone();
        assert_eq!(rotate_addresses(&mut msg, 1), 1);
        assert_eq!(
            addresses(&msg),
            [[10, 0, 0, 2], [10, 0, 0, 3], [10, 0, 0, 1]]
        );
        assert_eq!(msg.len(), before.len());
        rotate_addresses(&mut msg, 2);
        assert_eq!(msg, before, "three shifts by one third are the identity");
        rotate_addresses(&mut msg, 3);
        assert_eq!(msg, before);
    }

    #[test]
    fn every_shift_puts_a_different_address_first() {
        let ips = [[10, 0, 0, 1], [10, 0, 0, 2], [10, 0, 0, 3], [10, 0, 0, 4]];
        let firsts: std::collections::BTreeSet<_> = (0..4)
            .map(|shift| {
                let mut msg = reply(0, &ips, &[]);
                rotate_addresses(&mut msg, shift);
                let mut got = addresses(&msg);
                let first = got[0].clone();
                got.sort();
                assert_eq!(got, ips.map(|ip| ip.to_vec()), "the set is unchanged");
                first
            })
            .collect();
        assert_eq!(firsts.len(), 4);
    }

    #[test]
    fn error_replies_and_single_addresses_stay_as_they_are() {
        let ips = [[10, 0, 0, 1], [10, 0, 0, 2]];
        let mut nxdomain = reply(3, &ips, &[]);
        let before = nxdomain.clone();
        assert_eq!(rotate_addresses(&mut nxdomain, 1), 0);
        assert_eq!(nxdomain, before);
        let mut one = reply(0, &ips[..1], &[]);
        assert_eq!(rotate_addresses(&mut one, 1), 0);
    }

    #[test]
    fn addresses_of_different_owners_are_not_mixed() {
        let mut msg = reply(0, &[[10, 0, 0, 1]], &[]);
        // A second answer for `b.example.` (written in full).
        msg[7] = 2;
        msg.extend_from_slice(b"\x01b\x07example\x00\x00\x01\x00\x01\x00\x00\x00\x1e\x00\x04");
        msg.extend_from_slice(&[10, 0, 0, 2]);
        let before = msg.clone();
        assert_eq!(rotate_addresses(&mut msg, 1), 0);
        assert_eq!(msg, before);
    }

    #[test]
    fn a_truncated_message_is_left_alone() {
        let mut msg = reply(0, &[[10, 0, 0, 1], [10, 0, 0, 2]], &[]);
        msg.truncate(msg.len() - 2);
        let before = msg.clone();
        assert_eq!(rotate_addresses(&mut msg, 1), 0);
        assert_eq!(msg, before);
    }

    #[test]
    fn the_opt_size_is_set_where_there_is_an_opt() {
        let mut msg = reply(0, &[[10, 0, 0, 1]], &OPT);
        assert!(set_opt_size(&mut msg, 512));
        let at = msg.len() - 8;
        assert_eq!(get16(&msg, at), Some(512));
        let mut plain = reply(0, &[[10, 0, 0, 1]], &[]);
        let before = plain.clone();
        assert!(!set_opt_size(&mut plain, 512));
        assert_eq!(plain, before);
    }
}
