//! `reload`: how often the Corefile is checked for a change (`reload [INTERVAL] [JITTER]`),
//! process-wide as in CoreDNS (the last block's wins). Its logic is the app's `Reloader`.

use std::time::Duration;

use crate::config::corefile::Directive;
use crate::config::directives::{Out, Parsed, duration};

/// Reads a `reload` directive into the process-wide settings.
pub(crate) fn parse(d: &Directive, parsed: &mut Parsed, out: &mut Out<'_>) {
    out.no_block(d, "reload");
    if !out.arity(d, "reload", 0, 2, "reload [INTERVAL] [JITTER]") {
        return;
    }
    let interval = match d.args.first() {
        Some(w) => duration(w, "reload INTERVAL", out),
        None => Some(Duration::from_secs(30)),
    };
    let jitter = match d.args.get(1) {
        Some(w) => duration(w, "reload JITTER", out),
        None => Some(Duration::from_secs(15)),
    };
    let (Some(interval), Some(jitter)) = (interval, jitter) else {
        return;
    };
    if interval < Duration::from_secs(2) {
        out.err(d.line, "reload INTERVAL must be at least 2s".to_owned());
    } else if jitter < Duration::from_secs(1) {
        out.err(d.line, "reload JITTER must be at least 1s".to_owned());
    } else {
        // A JITTER above half the INTERVAL is lowered to it (CoreDNS); nodedns polls anyway.
        // One interval for the process: each block's `reload` sets it, so the last one wins, as
        // in CoreDNS (its setup of each block overwrites the interval).
        if let Some((old, first)) = parsed.reload.value.filter(|(old, _)| *old != interval) {
            out.warn(
                d.line,
                format!(
                    "reload: {interval:?} replaces {old:?} given at line {first}: the interval \
                     is one for the whole process, and the last block's wins, as in CoreDNS"
                ),
            );
        }
        parsed.reload.value = Some((interval, d.line));
    }
}
