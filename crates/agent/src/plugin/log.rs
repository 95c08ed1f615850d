//! `log`: the block's queries are logged, as CoreDNS 1.10's `plugin/log` reads it (`log [NAMES...]
//! [FORMAT] { class success|denial|error|all }`, several lines per block, the first rule covering
//! a name deciding; `config::querylog` reads the rules).
//!
//! Its logic is `serve::querylog`; its place in the chain is before the cache (it sees every
//! answer, hits included: the pipeline's `record`); no metrics of its own.

use crate::config::corefile::Directive;
use crate::config::directives::Out;
use crate::config::querylog::{self, LogClasses, LogRule};

/// One `log` line: its rules, appended to the block's in file order (CoreDNS's order).
pub(crate) fn parse(d: &Directive, out: &mut Out<'_>) -> Vec<LogRule> {
    let args: Vec<&str> = d.args.iter().map(|w| w.text.as_str()).collect();
    if let [only] = args.as_slice() {
        if only.contains('{') {
            out.warn(
                d.line,
                format!(
                    "log: `{only}` is taken as a name, as CoreDNS takes a single argument; write \
                     `log . {only}` for a format"
                ),
            );
        }
    }
    let mut classes = LogClasses::NONE;
    let before = out.problems.len();
    for o in &d.block {
        out.no_block(o, "log class");
        match o.name.as_str() {
            "class" => {
                let words: Vec<&str> = o.args.iter().map(|w| w.text.as_str()).collect();
                if let Err(e) = classes.add_line(&words) {
                    out.err(o.line, e);
                }
            }
            other => out.err(o.line, format!("unknown option `{other}` of `log`")),
        }
    }
    match querylog::rules(&args, classes) {
        Ok(rules) if out.problems.len() == before => rules,
        Ok(_) => Vec::new(),
        Err(e) => {
            out.err(d.line, e);
            Vec::new()
        }
    }
}
