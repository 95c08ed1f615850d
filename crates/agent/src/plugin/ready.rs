//! `ready`: the readiness endpoint (`ready [ADDRESS]`), process-wide as in CoreDNS. Its logic is
//! `crate::admin` (`/ready`) and the app's readiness latch.

use crate::config::corefile::Directive;
use crate::config::directives::{Ctx, Out, Parsed};
use crate::config::values;

/// Reads a `ready` directive into the process-wide settings.
pub(crate) fn parse(d: &Directive, parsed: &mut Parsed, ctx: &Ctx<'_>, out: &mut Out<'_>) {
    out.no_block(d, "ready");
    if out.arity(d, "ready", 0, 1, "ready [ADDRESS]") {
        let text = d.args.first().map_or(":8181", |w| w.text.as_str());
        match values::listen_addr(text) {
            Ok(a) => parsed.ready.set(a, d.line, "ready", ctx.file, out.problems),
            Err(e) => out.err(d.line, format!("ready: {e}")),
        }
    }
}
