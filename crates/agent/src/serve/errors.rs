//! The `errors` directive: a block's failed upstream exchanges logged, at most once per interval
//! per kind of failure with the count of the lines held back (an upstream that is down fails
//! every query: one line per query would drown the log). Without `errors` they are logged at
//! `debug` only. Counting them is the metrics' job, whatever the directive says.

use std::time::{Duration, Instant};

use crate::logging::{RateLimit, TypeName, name_text};
use crate::metrics::labels::{UNUSABLE_REPLY, UPSTREAM_ERRORS, upstream_error_kind};

/// How often a repeated upstream error of one kind in one block is logged.
pub const INTERVAL: Duration = Duration::from_secs(10);

/// One block's log of failed upstream exchanges.
#[derive(Debug)]
pub struct Errors {
    /// The block's zones, joined by commas (what the log line names).
    zones: String,
    /// One limit per kind of failure; `None` without the `errors` directive.
    limits: Option<[RateLimit; UPSTREAM_ERRORS.len()]>,
}

impl Errors {
    /// The log of a block serving `zones`, with (`errors`) or without the directive.
    pub fn new(zones: &[String], errors: bool) -> Self {
        let base = Instant::now();
        Errors {
            zones: zones.join(","),
            limits: errors.then(|| std::array::from_fn(|_| RateLimit::new(INTERVAL, base))),
        }
    }

    /// An upstream exchange for `qname` (wire form) of type `qtype` failed with `err`.
    pub fn failed(&self, qname: &[u8], qtype: u16, err: &nodedns_upstream::Error) {
        self.log(upstream_error_kind(err), qname, qtype, err);
    }

    /// The upstream's reply for `qname` of type `qtype` cannot be served: it fails to parse
    /// with `err`.
    pub fn unusable(&self, qname: &[u8], qtype: u16, err: &nodedns_wire::ReplyError) {
        let err = format_args!("unusable upstream reply: {err}");
        self.log(UNUSABLE_REPLY, qname, qtype, &err);
    }

    fn log(&self, kind: usize, qname: &[u8], qtype: u16, err: &dyn std::fmt::Display) {
        let Some(limits) = &self.limits else {
            tracing::debug!(%err, "upstream query failed");
            return;
        };
        let Some(held_back) = limits[kind].admit(Instant::now()) else {
            return;
        };
        tracing::error!(
            zones = self.zones.as_str(),
            qname = %name_text(qname),
            qtype = %TypeName(qtype),
            %err,
            similar_errors_not_logged = held_back,
            "upstream query failed (the same error is logged at most every {}s)",
            INTERVAL.as_secs()
        );
    }
}
