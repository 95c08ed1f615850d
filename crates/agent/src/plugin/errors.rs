//! `errors`: failed upstream exchanges of the block are logged, as CoreDNS's `plugin/errors`
//! (`errors [stdout]`; `stacktrace` and `consolidate` are accepted with a warning that says what
//! they change, `config::compat`). Its logic is `serve::errors`; its place in the chain is before
//! the cache, around every exchange the block's `forward` makes.

use crate::config::compat;
use crate::config::corefile::Directive;
use crate::config::directives::{Out, verdict};

/// Reads an `errors` directive; true: the block logs its errors.
pub(crate) fn parse(d: &Directive, out: &mut Out<'_>) -> bool {
    if out.arity(d, "errors", 0, 1, "errors [stdout]") {
        if let Some(w) = d.args.first().filter(|w| w.text != "stdout") {
            out.err(w.line, format!("errors: invalid log file `{}`", w.text));
        }
    }
    for o in &d.block {
        verdict(compat::errors_option(o), o.line, out);
    }
    true
}
