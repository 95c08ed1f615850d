//! Failed accepts, for every listener of the agent (the DNS TCP listeners and the admin ones).
//!
//! An accept that fails for want of a descriptor or of memory (EMFILE, ENFILE, ENOBUFS, ENOMEM)
//! leaves the connection queued in the kernel, so the next accept fails the same way at once:
//! retried without a pause, the loop spins, and logs a line per try. [`Backoff`] waits instead,
//! 5 ms doubling to 1 s (as Go's `net/http` does), until an accept succeeds, and logs one line
//! per 10 s with the count of the failures held back. Counting them is each listener's job.

use std::io;
use std::net::SocketAddr;
use std::time::{Duration, Instant};

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::registry::Registry;

use crate::logging::RateLimit;

/// The first wait after a failed accept; each failure in a row doubles it, up to [`LAST`].
pub const FIRST: Duration = Duration::from_millis(5);
pub const LAST: Duration = Duration::from_secs(1);
/// One log line per this interval about failed accepts, with the count held back.
pub const LOG_INTERVAL: Duration = Duration::from_secs(10);

/// The back-off of one accept loop.
#[derive(Debug)]
pub struct Backoff {
    /// What the log line calls the listener (`admin`, `DNS TCP`).
    listener: &'static str,
    /// The counter the failures are counted in, for the log line.
    counter: &'static str,
    /// The last wait, while accepts fail in a row.
    delay: Option<Duration>,
    log: RateLimit,
}

impl Backoff {
    pub fn new(listener: &'static str, counter: &'static str) -> Self {
        Backoff {
            listener,
            counter,
            delay: None,
            log: RateLimit::new(LOG_INTERVAL, Instant::now()),
        }
    }

    /// An accept succeeded: the next failure waits [`FIRST`] again.
    pub fn accepted(&mut self) {
        self.delay = None;
    }

    /// An accept on `address` failed with `err`: logs it (rate-limited) and returns how long to
    /// wait before the next accept.
    pub fn failed(&mut self, err: &io::Error, address: Option<SocketAddr>) -> Duration {
        let delay = self.delay.map_or(FIRST, |d| (d * 2).min(LAST));
        self.delay = Some(delay);
        if let Some(held_back) = self.log.admit(Instant::now()) {
            tracing::warn!(
                %err,
                address = ?address,
                held_back,
                "{} accept failed; backing off (counted in {})",
                self.listener,
                self.counter,
            );
        }
        delay
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn failures_in_a_row_double_the_wait_up_to_a_second_and_a_success_resets_it() {
        let mut backoff = Backoff::new("test", "test_total");
        let err = io::Error::from_raw_os_error(24); // EMFILE
        let waits: Vec<Duration> = (0..12).map(|_| backoff.failed(&err, None)).collect();
        assert_eq!(waits[0], FIRST);
        assert_eq!(waits[1], FIRST * 2);
        assert!(waits.windows(2).all(|w| w[1] >= w[0]));
        assert_eq!(*waits.last().unwrap(), LAST);
        backoff.accepted();
        assert_eq!(backoff.failed(&err, None), FIRST);
    }
}

/// The names and help texts of a listener's [`Refusals`] (prometheus-client appends `_total`).
#[derive(Debug)]
pub struct Names {
    pub accept_errors: &'static str,
    pub accept_errors_help: &'static str,
    pub closed: &'static str,
    pub closed_help: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct Reason {
    reason: &'static str,
}

/// What a listener refuses: its failed accepts, and the connections it closes, by reason.
#[derive(Debug, Clone, Default)]
pub struct Refusals {
    pub accept_errors: Counter,
    closed: Family<Reason, Counter>,
}

impl Refusals {
    /// Registers the counters under `names`.
    pub fn register(&self, registry: &mut Registry, names: &Names) {
        registry.register(
            names.accept_errors,
            names.accept_errors_help,
            self.accept_errors.clone(),
        );
        registry.register(names.closed, names.closed_help, self.closed.clone());
    }

    /// A connection closed for `reason`.
    pub fn closed(&self, reason: &'static str) {
        self.closed.get_or_create(&Reason { reason }).inc();
    }

    /// The connections closed for `reason` so far.
    #[cfg(test)]
    pub fn closed_count(&self, reason: &'static str) -> u64 {
        self.closed.get_or_create(&Reason { reason }).get()
    }
}
