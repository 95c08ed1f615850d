//! Directives and options node-cache's CoreDNS accepts that change nothing nodedns does, checked
//! as CoreDNS checks them and accepted with a one-line explanation (a warning, logged at every
//! load and printed by `--check-config`): `debug`, `metadata`, `pprof`, `trace`, and `errors`'
//! `stdout`, `stacktrace` and `consolidate`.

use super::corefile::Directive;
use super::values;

/// What a directive or option asks for: the explanation to log, or what is wrong with it (each
/// with its line).
pub(crate) type Verdict = Result<String, Vec<(usize, String)>>;

/// `debug`, `metadata`, `pprof` or `trace`; `None` for any other directive.
pub(crate) fn directive(d: &Directive) -> Option<Verdict> {
    let verdict = match d.name.as_str() {
        "debug" => no_args_or_block(d).map(|()| {
            "debug: accepted; it changes nothing in nodedns (CoreDNS's debug stops recovering \
             panics and prints its debug messages; nodedns's log level is set with --log-level or \
             /log-level)"
                .to_owned()
        }),
        "metadata" => metadata(d).map(|()| {
            "metadata: accepted; no plugin of nodedns provides metadata, so a log format's \
             `{/LABEL}` reads `-` (as CoreDNS writes a label nobody set)"
                .to_owned()
        }),
        "pprof" => pprof(d).map(|()| {
            "pprof: accepted; nodedns serves nothing there (CoreDNS serves Go runtime profiles, \
             which a Rust agent does not have)"
                .to_owned()
        }),
        "trace" => trace(d).map(|()| {
            "trace: accepted; nodedns sends no spans (CoreDNS sends OpenTracing spans to \
             zipkin or datadog; answers are the same either way)"
                .to_owned()
        }),
        _ => return None,
    };
    Some(verdict)
}

/// An option of `errors`' block.
pub(crate) fn errors_option(o: &Directive) -> Verdict {
    let problem = |m: &str| Err(vec![(o.line, format!("errors {}: {m}", o.name))]);
    if o.has_block {
        return problem("takes no `{ }` block");
    }
    match o.name.as_str() {
        "stacktrace" if o.args.is_empty() => Ok(
            "errors stacktrace: accepted; nodedns has no Go stack traces to log (a panic is \
             logged with its message and location)"
                .to_owned(),
        ),
        "stacktrace" => problem("takes no arguments"),
        "consolidate" => {
            if !(2..=3).contains(&o.args.len()) {
                return problem("expected `consolidate DURATION REGEXP [LEVEL]`");
            }
            if let Err(e) = values::go_duration(&o.args[0].text) {
                return problem(&e);
            }
            if let Some(level) = o.args.get(2) {
                if !["warning", "error", "info", "debug"].contains(&level.text.as_str()) {
                    return problem(&format!(
                        "LEVEL must be warning, error, info or debug, not `{}`",
                        level.text
                    ));
                }
            }
            Ok(format!(
                "errors consolidate {} {:?}: accepted; nodedns consolidates on its own: each kind \
                 of upstream failure of a block is logged at most once per interval, with the \
                 count of the lines held back (CoreDNS's REGEXP matches Go's error texts, which \
                 nodedns's are not)",
                o.args[0].text, o.args[1].text,
            ))
        }
        other => Err(vec![(
            o.line,
            format!("unknown option `{other}` of `errors`"),
        )]),
    }
}

fn no_args_or_block(d: &Directive) -> Result<(), Vec<(usize, String)>> {
    let mut problems = Vec::new();
    if !d.args.is_empty() {
        problems.push((d.line, format!("{}: takes no arguments", d.name)));
    }
    if d.has_block {
        problems.push((d.line, format!("{} takes no `{{ }}` block", d.name)));
    }
    none_or(problems)
}

/// `metadata [ZONES...]`: no block (CoreDNS 1.10 refuses one as an unknown property).
fn metadata(d: &Directive) -> Result<(), Vec<(usize, String)>> {
    let mut problems = Vec::new();
    for zone in &d.args {
        if let Err(e) = values::zone(&zone.text) {
            problems.push((zone.line, format!("metadata: {e}")));
        }
    }
    if let Some(o) = d.block.first() {
        problems.push((o.line, format!("unknown option `{}` of `metadata`", o.name)));
    } else if d.has_block {
        problems.push((d.line, "metadata takes no `{ }` block".to_owned()));
    }
    none_or(problems)
}

/// `pprof [ADDRESS] { block [RATE] }` (CoreDNS 1.10).
fn pprof(d: &Directive) -> Result<(), Vec<(usize, String)>> {
    let mut problems = Vec::new();
    match d.args.as_slice() {
        [] => {}
        [addr] => {
            if let Err(e) = values::listen_addr(&addr.text) {
                problems.push((d.line, format!("pprof: {e}")));
            }
        }
        _ => problems.push((d.line, "pprof: expected `pprof [ADDRESS]`".to_owned())),
    }
    for o in &d.block {
        let rate_ok = match o.args.as_slice() {
            [] => true,
            [rate] => rate.text.parse::<i64>().is_ok(),
            _ => false,
        };
        if o.name != "block" {
            problems.push((o.line, format!("unknown option `{}` of `pprof`", o.name)));
        } else if !rate_ok || o.has_block {
            problems.push((o.line, "pprof: expected `block [RATE]`".to_owned()));
        }
    }
    none_or(problems)
}

/// `trace [ENDPOINT-TYPE] [ENDPOINT] { ... }` with CoreDNS 1.10's options (values not checked
/// beyond their count: nothing uses them).
fn trace(d: &Directive) -> Result<(), Vec<(usize, String)>> {
    let mut problems = Vec::new();
    if d.args.len() > 2 {
        problems.push((
            d.line,
            "trace: expected `trace [ENDPOINT-TYPE] [ENDPOINT]`".to_owned(),
        ));
    }
    if let Some(kind) = d.args.first().filter(|_| d.args.len() == 2) {
        if !["zipkin", "datadog"].contains(&kind.text.as_str()) {
            problems.push((
                d.line,
                format!(
                    "trace: ENDPOINT-TYPE must be zipkin or datadog, not `{}`",
                    kind.text
                ),
            ));
        }
    }
    for o in &d.block {
        let args = match o.name.as_str() {
            "client_server" => 0..=0,
            "every"
            | "service"
            | "datadog_analytics_rate"
            | "zipkin_max_backlog_size"
            | "zipkin_max_batch_size"
            | "zipkin_max_batch_interval" => 1..=1,
            other => {
                problems.push((o.line, format!("unknown option `{other}` of `trace`")));
                continue;
            }
        };
        if !args.contains(&o.args.len()) || o.has_block {
            problems.push((o.line, format!("trace {}: wrong arguments", o.name)));
        }
    }
    none_or(problems)
}

fn none_or(problems: Vec<(usize, String)>) -> Result<(), Vec<(usize, String)>> {
    if problems.is_empty() {
        Ok(())
    } else {
        Err(problems)
    }
}
