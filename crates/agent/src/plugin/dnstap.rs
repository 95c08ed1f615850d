//! `dnstap`: the block's queries and answers as dnstap messages to a sink, as CoreDNS's
//! `plugin/dnstap` configures it. Its logic is `crate::dnstap`; its place in the chain is before
//! the cache (it sees every query, hits included).

use crate::config::corefile::Directive;
use crate::config::directives::Out;
use crate::config::{Dnstap, Sink};

/// `dnstap SOCKET [full] [WRITEBUFFER] [QUEUE] { identity ID; version V; extra E; skipverify }`:
/// CoreDNS 1.10's syntax (SOCKET, `full`, `identity`, `version`) and newer CoreDNS's buffer and
/// queue multipliers and `extra`. Not implemented, and said so: `tls://` sinks and `dnstap
/// listen` (sinks that connect to the server), and metadata placeholders in `extra`.
pub(crate) fn parse(d: &Directive, out: &mut Out<'_>) -> Option<Dnstap> {
    const SYNTAX: &str = "dnstap SOCKET [full] [WRITEBUFFER] [QUEUE]";
    if d.args.first().is_some_and(|w| w.text == "listen") {
        out.err(
            d.line,
            "dnstap listen (sinks that connect to nodedns) is not implemented: give the sink's \
             socket, `dnstap unix:///PATH` or `dnstap tcp://HOST:PORT`"
                .to_owned(),
        );
        return None;
    }
    if !out.arity(d, "dnstap", 1, 4, SYNTAX) {
        return None;
    }
    let socket = d.args[0].text.as_str();
    let sink = if let Some(rest) = socket.strip_prefix("tcp://") {
        let host = rest.trim_end_matches('/');
        match host.rsplit_once(':') {
            Some((h, port)) if !h.is_empty() && port.parse::<u16>().is_ok() => {
                Sink::Tcp(host.to_owned())
            }
            _ => {
                out.err(
                    d.line,
                    format!("dnstap: `{socket}`: a TCP sink is `tcp://HOST:PORT`"),
                );
                return None;
            }
        }
    } else if socket.starts_with("tls://") {
        out.err(
            d.line,
            format!(
                "dnstap: `{socket}`: TLS sinks are not implemented; use a Unix socket or \
                 `tcp://` (to a relay on the node, for example)"
            ),
        );
        return None;
    } else if socket.contains("://") && !socket.starts_with("unix://") {
        out.err(
            d.line,
            format!("dnstap: `{socket}`: the socket is a path, `unix://PATH` or `tcp://HOST:PORT`"),
        );
        return None;
    } else {
        let path = socket.strip_prefix("unix://").unwrap_or(socket);
        if path.is_empty() {
            out.err(d.line, "dnstap: the socket path is empty".to_owned());
            return None;
        }
        Sink::Unix(path.into())
    };
    let mut config = Dnstap::new(sink);
    match d.args.get(1).map(|w| w.text.as_str()) {
        Some("full") => config.full = true,
        Some(other) => out.err(
            d.line,
            format!("dnstap: expected `full` after the socket, got `{other}`"),
        ),
        None => {}
    }
    let multiplier = |i: usize, what: &str, max: usize, out: &mut Out<'_>| -> Option<usize> {
        let w = d.args.get(i)?;
        match w.text.parse::<usize>() {
            Ok(v) if (1..=max).contains(&v) => Some(v),
            _ => {
                out.err(
                    w.line,
                    format!(
                        "dnstap {what}: `{}` is not a whole number from 1 to {max}",
                        w.text
                    ),
                );
                None
            }
        }
    };
    if let Some(v) = multiplier(2, "WRITEBUFFER (MiB)", 1024, out) {
        config.write_buffer = v * Dnstap::WRITE_BUFFER;
    }
    if let Some(v) = multiplier(3, "QUEUE (times 10,000 messages)", 4096, out) {
        config.queue = v * Dnstap::QUEUE;
    }
    for o in &d.block {
        out.no_block(o, &format!("dnstap {}", o.name));
        let one = |o: &Directive, out: &mut Out<'_>| -> Option<String> {
            let syntax = format!("{} VALUE", o.name);
            out.arity(o, &format!("dnstap {}", o.name), 1, 1, &syntax)
                .then(|| o.args[0].text.clone())
        };
        match o.name.as_str() {
            "identity" => config.identity = one(o, out),
            "version" => config.version = one(o, out),
            "extra" => {
                let extra = one(o, out);
                if extra.as_deref().is_some_and(|e| e.contains('{')) {
                    out.err(
                        o.line,
                        "dnstap extra: metadata placeholders (`{...}`) are not implemented; \
                         give the text as it should be written"
                            .to_owned(),
                    );
                }
                config.extra = extra;
            }
            "skipverify" => {
                out.arity(o, "dnstap skipverify", 0, 0, "skipverify");
                out.warn(
                    o.line,
                    "dnstap skipverify: no effect (it concerns TLS sinks)".to_owned(),
                );
            }
            "tls" => out.err(
                o.line,
                "dnstap tls: TLS is not implemented (and CoreDNS takes `tls` only with `dnstap \
                 listen`)"
                    .to_owned(),
            ),
            other => out.err(o.line, format!("unknown option `{other}` of `dnstap`")),
        }
    }
    Some(config)
}
