//! `loop`: at start, a probe query sent through the block's `forward` tells whether queries come
//! back to this agent (a forwarding loop), as CoreDNS's `plugin/loop`. Its logic is
//! `serve::loopcheck`, run by the app once the listeners serve.

use crate::config::corefile::Directive;
use crate::config::directives::Out;

/// Reads a `loop` directive; true: the block is probed.
pub(crate) fn parse(d: &Directive, out: &mut Out<'_>) -> bool {
    out.no_block(d, "loop");
    out.arity(d, "loop", 0, 0, "loop");
    true
}
