//! `prometheus`: the metrics endpoint (`prometheus [ADDRESS]`), process-wide: every address any
//! block gives is served, all on one registry (CoreDNS opens one listener per address). Its
//! logic is `crate::admin` (`/metrics`) over `crate::metrics`' exposition and every plugin's
//! registered `Metrics`.

use crate::config::corefile::Directive;
use crate::config::directives::{Out, Parsed};
use crate::config::values;

/// Reads a `prometheus` directive into the process-wide settings: the first address is
/// `metrics`, the others of other blocks `extra_metrics`.
pub(crate) fn parse(d: &Directive, parsed: &mut Parsed, out: &mut Out<'_>) {
    out.no_block(d, "prometheus");
    if out.arity(d, "prometheus", 0, 1, "prometheus [ADDRESS]") {
        let text = d.args.first().map_or("localhost:9153", |w| w.text.as_str());
        match values::listen_addr(text) {
            Ok(a) => match parsed.metrics.get() {
                None => parsed.metrics.value = Some((a, d.line)),
                Some(first) if first == a => {}
                Some(_) if parsed.extra_metrics.contains(&a) => {}
                Some(_) => parsed.extra_metrics.push(a),
            },
            Err(e) => out.err(d.line, format!("prometheus: {e}")),
        }
    }
}
