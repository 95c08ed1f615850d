//! `health`: the liveness endpoint (`health [ADDRESS] { lameduck DURATION }`), process-wide as in
//! CoreDNS (one address, the same in every block that names it). Its logic is `crate::admin`
//! (`/health`) and the app's shutdown order (`lameduck`).

use crate::config::corefile::Directive;
use crate::config::directives::{Ctx, Out, Parsed};
use crate::config::values;

/// Reads a `health` directive into the process-wide settings.
pub(crate) fn parse(d: &Directive, parsed: &mut Parsed, ctx: &Ctx<'_>, out: &mut Out<'_>) {
    if out.arity(d, "health", 0, 1, "health [ADDRESS]") {
        let text = d.args.first().map_or(":8080", |w| w.text.as_str());
        match values::listen_addr(text) {
            Ok(a) => parsed
                .health
                .set(a, d.line, "health", ctx.file, out.problems),
            Err(e) => out.err(d.line, format!("health: {e}")),
        }
    }
    for o in &d.block {
        match o.name.as_str() {
            "lameduck" => {
                out.no_block(o, "health lameduck");
                if out.arity(o, "health lameduck", 1, 1, "lameduck DURATION") {
                    match values::go_duration(&o.args[0].text) {
                        Ok(v) => parsed.lameduck.set(
                            v,
                            o.line,
                            "health lameduck",
                            ctx.file,
                            out.problems,
                        ),
                        Err(e) => out.err(o.line, format!("health lameduck: {e}")),
                    }
                }
            }
            other => out.err(o.line, format!("unknown option `{other}` of `health`")),
        }
    }
}
