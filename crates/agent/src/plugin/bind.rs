//! `bind`: the addresses a block listens on (`bind ADDRESS|IFACE... { except ADDRESS|IFACE... }`),
//! as CoreDNS's `plugin/bind`: an interface stands for the addresses it has when the
//! configuration is read. Its logic is the listeners' (`serve::udp`, `serve::tcp`).

use std::collections::BTreeMap;
use std::net::IpAddr;

use crate::config::corefile::{Directive, Word};
use crate::config::directives::Out;

/// One `bind` line: its addresses and interfaces, less its own `except` list (CoreDNS applies
/// `except` to the line it is written in), added to `bind`. An interface stands for the
/// addresses it has when the configuration is read, IPv6 link-local ones excepted (CoreDNS's
/// rule: they need a zone to be bound).
pub(crate) fn parse(
    d: &Directive,
    bind: &mut Vec<IpAddr>,
    interfaces: &BTreeMap<String, Vec<IpAddr>>,
    out: &mut Out<'_>,
) {
    if d.args.is_empty() {
        out.err(
            d.line,
            "bind: expected `bind ADDRESS|IFACE...`, got no address".to_owned(),
        );
    }
    let addrs = |words: &[Word], out: &mut Out<'_>| {
        let mut ips = Vec::new();
        for w in words {
            // An interface first, as CoreDNS looks names up.
            if let Some(list) = interfaces.get(&w.text) {
                ips.extend(list.iter().copied().filter(|ip| match ip {
                    IpAddr::V4(_) => true,
                    IpAddr::V6(v6) => (v6.segments()[0] & 0xffc0) != 0xfe80,
                }));
                continue;
            }
            match w.text.parse::<IpAddr>() {
                Ok(ip) => ips.push(ip),
                Err(_) => out.err(
                    w.line,
                    format!(
                        "bind: `{}` is not an IP address nor an interface of this host ({}; IPv6 \
                         zones are not implemented)",
                        w.text,
                        if interfaces.is_empty() {
                            "none found".to_owned()
                        } else {
                            let names: Vec<&str> = interfaces.keys().map(String::as_str).collect();
                            format!("interfaces: {}", names.join(" "))
                        }
                    ),
                ),
            }
        }
        ips
    };
    let listed = addrs(&d.args, out);
    let mut except = Vec::new();
    for o in &d.block {
        match o.name.as_str() {
            "except" => {
                out.no_block(o, "bind except");
                if out.arity(o, "bind except", 1, usize::MAX, "except ADDRESS|IFACE...") {
                    except.extend(addrs(&o.args, out));
                }
            }
            other => out.err(o.line, format!("unknown option `{other}` of `bind`")),
        }
    }
    for ip in listed {
        if !except.contains(&ip) && !bind.contains(&ip) {
            bind.push(ip);
        }
    }
}
